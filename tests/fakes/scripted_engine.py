"""A deterministic engine that replies with scripted text, for tests of the agent loop.

A *script* maps the prompt (decoded) and the turn number to the reply text; the engine
tokenizes the reply with a real tokenizer, adds the end-of-turn token, and returns it the
way a model server would: cut at the first stop token, cut at ``max_new_tokens``
(finish ``length``), and on ``abort`` resolved with the tokens produced so far (finish
``abort``). With ``token_delay_s`` each token costs that much time (virtual time under
:mod:`tailcut.vtime`), so a cut can land in the middle of a generation; a subclass may
charge some requests more (:meth:`ScriptedEngine.token_delay`).

Scripts can call tools (``format_tool_call``), answer, or ramble (a long reply that only
``max_new_tokens`` stops). A request with ``seed_offset = k`` continues a cut generation: it
gets the reply from its ``k``-th token on (the first ``k`` are already in its prompt).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tailcut.chat.template import IM_END, IM_START, ChatTokenizer, decode, encode
from tailcut.engine.base import BaseEngine, EngineStats
from tailcut.types import FinishReason, GenerateRequest, GenerateResult


@dataclass(frozen=True, slots=True)
class ScriptCall:
    prompt_text: str
    """The request's prompt, decoded (special tokens kept)."""
    turn: int
    """Assistant turns already in the prompt (0 on the first call of a conversation)."""
    request: GenerateRequest


Script = Callable[[ScriptCall], str]


def count_turns(prompt_text: str) -> int:
    """Assistant turns before the generation prompt of a ChatML conversation."""
    return max(prompt_text.count(f"{IM_START}assistant") - 1, 0)


def ramble(words: int, seed: int = 0) -> str:
    """Deterministic filler text of ``words`` words (a reply that never gets to the point)."""
    vocab = ("the", "number", "of", "apples", "is", "more", "than", "half", "so", "we", "add")
    return " ".join(vocab[(seed + 7 * i) % len(vocab)] for i in range(words))


class ScriptedEngine(BaseEngine):
    """Replies with ``script(call)`` + the end-of-turn token; see the module docstring."""

    name = "scripted"

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        script: Script,
        *,
        token_delay_s: float = 0.0,
        prefill_delay_s: float = 0.0,
        end_token: str | None = IM_END,
        weight_version: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.token_delay_s = token_delay_s
        self.prefill_delay_s = prefill_delay_s
        self.end_ids = encode(tokenizer, end_token) if end_token else []
        self.weight_version = weight_version
        self.requests: list[GenerateRequest] = []
        self.results: list[GenerateResult] = []
        self.aborted: list[str] = []
        """Ids stopped while they ran, by ``abort`` or by cancelling the caller (in order)."""
        self.abort_requests: list[str] = []
        """Every id passed to ``abort`` (unknown and finished ones included)."""
        self._running: dict[str, asyncio.Event] = {}
        self._wasted = 0

    def reply_ids(self, request: GenerateRequest) -> list[int]:
        text = decode(self.tokenizer, request.prompt_ids)
        reply = self.script(ScriptCall(text, count_turns(text), request))
        # A continued generation (``seed_offset`` tokens of this reply already at the end of
        # the prompt) goes on with the rest of the same reply, as a seeded stream would.
        return (encode(self.tokenizer, reply) + self.end_ids)[request.sampling.seed_offset :]

    @staticmethod
    def _plan(ids: list[int], request: GenerateRequest) -> tuple[list[int], FinishReason]:
        sampling = request.sampling
        if not sampling.ignore_eos:
            stops = set(sampling.stop_token_ids)
            for k, tid in enumerate(ids):
                if tid in stops:
                    ids = ids[: k + 1]
                    break
        if len(ids) > sampling.max_new_tokens:
            return ids[: sampling.max_new_tokens], FinishReason.LENGTH
        if sampling.ignore_eos and len(ids) < sampling.max_new_tokens:
            return ids, FinishReason.LENGTH
        return ids, FinishReason.STOP

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        planned, reason = self._plan(self.reply_ids(request), request)
        stop = asyncio.Event()
        self._running[request.request_id] = stop
        out: list[int] = []
        try:
            await self._emit(planned, stop, out, self.token_delay(request))
        except asyncio.CancelledError:
            self._stopped(request.request_id, out)
            raise
        finally:
            del self._running[request.request_id]
        if stop.is_set():
            reason = FinishReason.ABORT
            self._stopped(request.request_id, out)
        result = GenerateResult(
            request_id=request.request_id,
            output_ids=out,
            finish_reason=reason,
            logprobs=[_logprob(t) for t in out],
            weight_version=self.weight_version,
            prompt_tokens=len(request.prompt_ids),
        )
        self.results.append(result)
        return result

    def token_delay(self, request: GenerateRequest) -> float:
        """Seconds each token of ``request`` takes (``token_delay_s`` for every request)."""
        return self.token_delay_s

    async def _emit(
        self, planned: list[int], stop: asyncio.Event, out: list[int], delay: float
    ) -> None:
        """Produce ``planned`` into ``out`` token by token until done or stopped."""
        if self.prefill_delay_s > 0 and await _wait(stop, self.prefill_delay_s):
            return
        if delay <= 0:
            if not stop.is_set():
                out.extend(planned)
            return
        for tid in planned:
            if await _wait(stop, delay):
                return
            out.append(tid)

    def _stopped(self, request_id: str, out: list[int]) -> None:
        self.aborted.append(request_id)
        self._wasted += len(out)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.abort_requests.extend(request_ids)
        for rid in request_ids:
            event = self._running.get(rid)
            if event is not None:
                event.set()

    async def in_flight(self) -> list[str]:
        return list(self._running)

    async def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            aborted=len(self.aborted),
            wasted_tokens=self._wasted,
            tokens_after_abort=0,
        )


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` unless ``stop`` is set first; True if it was."""
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return False
    return True


def _logprob(token_id: int) -> float:
    """A fixed, token-dependent log-prob, so tests can check alignment."""
    return -0.01 * (1 + token_id % 97)
