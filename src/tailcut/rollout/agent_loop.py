"""The multi-turn agent loop: a rollout fn that generates, parses tool calls, runs them,
and repeats.

One trajectory::

    render prompt (messages + tool schemas) ─► generate ─► parse ─┬─ no call ───────► stop
          ▲                                                       ├─ max_turns ─────► max_turns
          │                                                       ├─ engine length ─► length
          └──── append tool results (mask 0) ◄── run calls ◄──────┘  engine abort ──► abort
                (delta would pass max_response_tokens ⇒ length)      (concurrently)

Tokens are appended as they come (:mod:`tailcut.chat.tokenize`): sampled tokens with mask
1, tool output and template-forced tokens with mask 0. A bad tool call (malformed JSON,
unknown tool, bad arguments, over the per-turn limit) is answered with a tool message that
explains the error; the trajectory goes on.

Cancellation (a cut): the in-flight ``generate`` is aborted by the engine contract, the
in-flight tool calls are cancelled with their TaskGroup, the tool session releases every
tool instance, and the sample keeps what it has (tokens, masks, turns, messages) before
``CancelledError`` is re-raised. The reward is computed once at the end (not for aborted
trajectories) by a pluggable ``reward_fn(sample, tool_rewards)``; an exception from it
propagates, so the scheduler records the sample as FAILED with that error.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import secrets
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tailcut.chat.parser import ParsedTurn, ToolCall, ToolCallError, get_parser
from tailcut.chat.template import ChatTokenizer, stop_token_ids
from tailcut.chat.tokenize import IncrementalChat, append_forced, append_sampled
from tailcut.config import AgentLoopConfig
from tailcut.engine.base import Engine, EngineError
from tailcut.rollout.seeds import call_seed
from tailcut.tools.base import ToolResult, ToolSession, ToolSet
from tailcut.trace.events import EventKind, Tracer
from tailcut.types import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Sample,
    SamplingParams,
    Turn,
    new_request_id,
    token_array,
)

RewardFn = Callable[[Sample, Mapping[str, float]], float | Awaitable[float]]
"""``reward_fn(sample, tool_rewards) -> float`` (or an awaitable of it)."""

TRUNCATION_MARK = "...(truncated)"


def prompt_messages(sample: Sample) -> list[dict[str, Any]]:
    """The chat messages a sample starts from: ``data["messages"]`` (a validated prompt row)
    or ``data["prompt"]`` (verl's column, as read from the parquet file)."""
    key = "messages" if "messages" in sample.data else "prompt"
    raw = sample.data.get(key)
    if raw is None:
        raise ValueError(
            f"sample {sample.index}: data has no 'messages' or 'prompt' (a list of chat messages)"
        )
    if isinstance(raw, str) or not hasattr(raw, "__iter__"):
        raise ValueError(
            f"sample {sample.index}: {key!r} must be a list of messages, got {raw!r:.80}"
        )
    messages = [dict(m) for m in raw]
    for k, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(
                f"sample {sample.index}: prompt message {k} needs string 'role' and 'content', "
                f"got {message!r:.120}"
            )
    if not messages:
        raise ValueError(f"sample {sample.index}: {key!r} is empty")
    return messages


def tool_create_kwargs(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-tool ``create_kwargs`` from verl's ``tools_kwargs`` (top level or in ``extra_info``)."""
    extra = data.get("extra_info")
    spec = data.get("tools_kwargs") or (
        extra.get("tools_kwargs") if isinstance(extra, Mapping) else None
    )
    out: dict[str, dict[str, Any]] = {}
    for name, entry in dict(spec or {}).items():
        kwargs = entry.get("create_kwargs") if isinstance(entry, Mapping) else None
        out[str(name)] = dict(kwargs or {})
    return out


@contextmanager
def finish_reason_on_error(sample: Sample) -> Iterator[None]:
    """Record why a trajectory ended early: ``abort`` when it is cancelled (a cut),
    ``failed`` on an error; the exception goes on either way."""
    try:
        yield
    except asyncio.CancelledError:
        sample.finish_reason = FinishReason.ABORT
        raise
    except Exception:
        sample.finish_reason = FinishReason.FAILED
        raise


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATION_MARK


class AgentLoop:
    """A :class:`~tailcut.rollout.step.RolloutFn` for multi-turn tool use."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        cfg: AgentLoopConfig | None = None,
        *,
        toolset: ToolSet | None = None,
        reward_fn: RewardFn | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        require_logprobs: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.require_logprobs = require_logprobs
        """A generation whose tokens come back without log-probs fails the sample (training
        that uses the engine's log-probs); otherwise they are recorded as NaN."""
        self.cfg = cfg or AgentLoopConfig()
        self.toolset = toolset or ToolSet({})
        self.reward_fn = reward_fn
        self.template_kwargs = dict(template_kwargs or {})
        self.parser = get_parser(
            self.cfg.tool_parser,
            chat_template=getattr(tokenizer, "chat_template", None),
            max_call_chars=self.cfg.max_tool_call_chars,
        )
        self.stop_ids = stop_token_ids(tokenizer)
        self.schemas = self.toolset.schemas() or None

    async def __call__(self, sample: Sample, engine: Engine, tracer: Tracer) -> None:
        if sample.response_ids or sample.turns:
            raise ValueError(
                f"sample {sample.index} already holds a response; the agent loop starts "
                "trajectories from their prompt"
            )
        with finish_reason_on_error(sample):
            chat = IncrementalChat(
                self.tokenizer,
                prompt_messages(sample),
                self.schemas,
                stop_ids=self.stop_ids,
                template_kwargs=self.template_kwargs,
                parser=self.parser,
            )
            sample.prompt_ids = token_array(chat.prompt_ids)
            sample.messages = chat.messages  # the same list: grows with the conversation
            instance_id = f"{sample.workid}-{secrets.token_hex(4)}"
            async with self.toolset.session(
                instance_id, tool_create_kwargs(sample.data)
            ) as session:
                run = _Trajectory(self, sample, engine, tracer, chat, session)
                sample.finish_reason = await run.turns()
                if sample.finish_reason is not FinishReason.ABORT:
                    await self._score_whole(sample, session)

    async def _score_whole(self, sample: Sample, session: ToolSession) -> None:
        """Score a trajectory that is whole. A cut that lands while it is scored does not
        make it a cut-off one: the scoring goes on (a second cancel — the step's settling
        deadline passing — ends it, and the sample is aborted after all)."""
        scoring = asyncio.ensure_future(self._score(sample, session))
        try:
            await asyncio.shield(scoring)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if scoring.done() or task is None:
                raise
            task.uncancel()
            await scoring

    async def _score(self, sample: Sample, session: ToolSession) -> None:
        tool_rewards = await session.rewards()
        for name, tool_reward in tool_rewards.items():
            sample.reward_info[f"tool/{name}"] = float(tool_reward)
        if self.reward_fn is None:
            return
        value = self.reward_fn(sample, tool_rewards)
        sample.reward = float(await value if inspect.isawaitable(value) else value)


class _Trajectory:
    """The state of one running trajectory (keeps the loop's steps small)."""

    def __init__(
        self,
        loop: AgentLoop,
        sample: Sample,
        engine: Engine,
        tracer: Tracer,
        chat: IncrementalChat,
        session: ToolSession,
    ) -> None:
        self.cfg = loop.cfg
        self.parser = loop.parser
        self.stop_ids = loop.stop_ids
        self.sample = sample
        self.engine = engine
        self.tracer = tracer
        self.chat = chat
        self.session = session
        self.clock = asyncio.get_running_loop().time
        self.require_logprobs = loop.require_logprobs

    async def turns(self) -> FinishReason:
        for index in range(self.cfg.max_turns):
            reason = await self._turn(index)
            if reason is not None:
                return reason
        raise AssertionError("unreachable: the last turn returns max_turns")  # pragma: no cover

    async def _turn(self, index: int) -> FinishReason | None:
        sample = self.sample
        budget = self.cfg.max_response_tokens - len(sample.response_ids)
        if budget <= 0 and not self._continues(index):
            return FinishReason.LENGTH
        turn = self._open_turn(index)
        self.tracer.emit(EventKind.TURN_START, sample.workid, turn=index)
        started, status = self.clock(), "ok"
        reason: FinishReason | None = None
        try:
            reason = await self._turn_body(turn, budget)
            return reason
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception:
            status = "failed"
            raise
        finally:
            self.tracer.emit(
                EventKind.TURN_END,
                sample.workid,
                duration_sec=self.clock() - started,
                turn=index,
                status=status,
                finish_reason=reason.value if reason else None,
                tool_calls=turn.tool_calls,
                tool_errors=turn.tool_errors,
            )

    def _continues(self, index: int) -> bool:
        """Whether turn ``index`` is one a cut left open (it is recorded even with no
        budget left: its tokens must reach the conversation)."""
        return False

    def _open_turn(self, index: int) -> Turn:
        """The record of turn ``index``: a new one, appended to the sample."""
        sample = self.sample
        turn = Turn(
            index=index,
            request_id=new_request_id(),
            prompt_tokens=len(sample.prompt_ids) + len(sample.response_ids),
        )
        sample.turns.append(turn)
        return turn

    async def _turn_body(self, turn: Turn, budget: int) -> FinishReason | None:
        result = await self._generate(turn, budget)
        # No await between the result and recording it: a cut that lands now must find
        # the tokens in the sample.
        content = self.chat.add_assistant(result.output_ids)
        if result.finish_reason is FinishReason.FAILED:
            raise EngineError(
                f"engine {self.engine.name} failed request {turn.request_id}: "
                f"{result.error or 'no error message'}"
            )
        if result.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH):
            return result.finish_reason
        parsed = self.parser.parse(content)
        if not parsed.items:
            return FinishReason.STOP
        if turn.index + 1 >= self.cfg.max_turns:
            return FinishReason.MAX_TURNS
        messages = await self._run_tools(turn, parsed)
        before = len(self.chat.messages)
        forced = self.chat.add_messages(messages)
        if len(self.sample.response_ids) + len(forced) >= self.cfg.max_response_tokens:
            # As in verl: the trajectory ends on the model's own last token — and so does
            # its conversation (the tool answers leave with their tokens)
            del self.chat.messages[before:]
            return FinishReason.LENGTH
        append_forced(self.sample, forced)
        return None

    async def _generate(self, turn: Turn, budget: int) -> GenerateResult:
        """Sample the rest of ``turn``: what ``max_new_tokens`` leaves after the tokens the
        turn already has (a turn continued after a cut), within ``budget``. The turn's seed
        depends on its index only; its stream goes on after the tokens it already drew."""
        sample = self.sample
        have = turn.output_tokens
        max_new = min(self.cfg.max_new_tokens - have, budget)
        if max_new <= 0:  # a continued turn that had already sampled all it may
            turn.finish_reason = FinishReason.LENGTH
            return GenerateResult(turn.request_id, [], FinishReason.LENGTH, [])
        sampling = SamplingParams(
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_new_tokens=max_new,
            stop_token_ids=tuple(self.stop_ids),
            seed=None if sample.seed is None else call_seed(sample.seed, turn.index + 1),
            seed_offset=have,
        )
        request = GenerateRequest(
            turn.request_id, sample.prompt_ids + sample.response_ids, sampling
        )
        started = self.clock()
        sample.active_request_id = request.request_id
        try:
            result = await self.engine.generate(request)
        except asyncio.CancelledError:
            self._engine_call_end(turn, started, FinishReason.ABORT, cancelled=True)
            raise
        except Exception:
            self._engine_call_end(turn, started, FinishReason.FAILED)
            raise
        finally:
            sample.active_request_id = None
        self._check_logprobs(request, result)
        turn.output_tokens = have + len(result.output_ids)
        turn.weight_version = result.weight_version
        append_sampled(sample, result.output_ids, result.logprobs, result.weight_version)
        self._engine_call_end(
            turn, started, result.finish_reason, new_tokens=len(result.output_ids)
        )
        return result

    def _check_logprobs(self, request: GenerateRequest, result: GenerateResult) -> None:
        if not self.require_logprobs or not result.output_ids:
            return
        lps = result.logprobs
        missing = len(result.output_ids) if lps is None else sum(not math.isfinite(x) for x in lps)
        if missing:
            raise EngineError(
                f"engine {self.engine.name} returned no log-prob for {missing} of "
                f"{len(result.output_ids)} tokens of request {request.request_id} (training "
                "uses them: algo.old_logprobs=engine or a rollout_correction)"
            )

    def _engine_call_end(
        self,
        turn: Turn,
        started: float,
        reason: FinishReason,
        cancelled: bool = False,
        new_tokens: int | None = None,
    ) -> None:
        """Trace the call: ``output_tokens`` is the turn's so far; ``new_tokens`` what this
        call sampled (less, where it continues a turn an earlier step's cut left open)."""
        seconds = self.clock() - started
        turn.finish_reason = reason
        turn.engine_s += seconds  # a continued turn adds its calls up
        extra: dict[str, Any] = {"cancelled": True} if cancelled else {}
        if new_tokens is not None:
            extra["new_tokens"] = new_tokens
        self.tracer.emit(
            EventKind.TURN_ENGINE_CALL,
            self.sample.workid,
            duration_sec=seconds,
            turn=turn.index,
            engine_request_id=turn.request_id,
            prompt_tokens=turn.prompt_tokens,
            output_tokens=turn.output_tokens,
            finish_reason=reason.value,
            **extra,
        )

    async def _run_tools(self, turn: Turn, parsed: ParsedTurn) -> list[dict[str, Any]]:
        """Run the turn's calls concurrently; one tool message per block, in text order."""
        started = self.clock()
        results: dict[int, ToolResult] = {}
        calls_seen = 0
        turn.tool_calls = len(parsed.items)
        try:
            async with asyncio.TaskGroup() as tg:
                for k, item in enumerate(parsed.items):
                    if isinstance(item, ToolCall):
                        calls_seen += 1
                        if calls_seen <= self.cfg.max_tool_calls_per_turn:
                            tg.create_task(self._call(turn, k, item, results))
        finally:
            turn.tool_s = self.clock() - started
        return [self._message(turn, item, results.get(k)) for k, item in enumerate(parsed.items)]

    async def _call(
        self, turn: Turn, k: int, call: ToolCall, results: dict[int, ToolResult]
    ) -> None:
        started = self.clock()
        status = "cancelled"
        try:
            result = await self.session.call(call.name, call.arguments)
            results[k] = result
            status = result.status
        finally:
            self.tracer.emit(
                EventKind.TOOL_CALL,
                self.sample.workid,
                duration_sec=self.clock() - started,
                turn=turn.index,
                name=call.name,
                status=status,
            )

    def _message(
        self, turn: Turn, item: ToolCall | ToolCallError, result: ToolResult | None
    ) -> dict[str, Any]:
        if isinstance(item, ToolCallError):
            turn.tool_errors += 1
            turn.tool_parse_errors += 1
            self._trace_unrun(turn, item.name or "", "parse_error")
            message = {"role": "tool", "content": item.message()}
            return message | ({"name": item.name} if item.name else {})
        if result is None:  # over the per-turn limit: not run
            turn.tool_errors += 1
            self._trace_unrun(turn, item.name, "over_limit")
            text = (
                f"Error: call not run: at most {self.cfg.max_tool_calls_per_turn} tool calls "
                "per turn."
            )
            return {"role": "tool", "name": item.name, "content": text}
        if result.is_error:
            turn.tool_errors += 1
        text = _truncate(result.text, self.cfg.max_tool_response_chars)
        return {"role": "tool", "name": item.name, "content": text}

    def _trace_unrun(self, turn: Turn, name: str, status: str) -> None:
        self.tracer.emit(
            EventKind.TOOL_CALL, self.sample.workid, turn=turn.index, name=name, status=status
        )
