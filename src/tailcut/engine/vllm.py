"""vLLM's OpenAI-compatible server over HTTP (``python -m vllm.entrypoints.openai.api_server``).

Generation is a streamed ``POST /v1/completions`` with a token-id prompt::

    {"model", "prompt": [ids], "max_tokens", "temperature", "top_p", "stop_token_ids",
     "ignore_eos", "seed", "logprobs": 0, "return_token_ids": true, "stream": true,
     "request_id": "<24-char id>"}

Each ``data:`` event carries the new ``token_ids`` and their ``logprobs.token_logprobs``
(the sampled token's log-prob; a missing one is NaN, never 0). Which distribution it is
depends on how the server was started, and is declared in ``engine.remote.logprobs``:
vLLM's default ``--logprobs-mode raw_logprobs`` is the model before temperature/top-p
(``raw``), ``processed_logprobs`` the distribution sampled from (``sampled``). The server
names the request ``cmpl-<request_id>-0``.

Abort: vLLM aborts a request whose client goes away, so the client closes the stream;
servers started with ``VLLM_SERVER_DEV_MODE=1`` also offer ``POST /abort_requests
{"request_ids": [...]}``, which is sent first when present. Verification reads ``GET
/metrics`` (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``).

Where the server offers them (``VLLM_SERVER_DEV_MODE=1``): :meth:`sleep` / :meth:`wake_up`
(``/sleep?level=``, ``/wake_up?tags=``; GPU memory is only freed with
``--enable-sleep-mode``) and :meth:`update_weights_from_disk` (``/pause?mode=wait`` →
``/collective_rpc`` ``reload_weights(weights_path=…)`` → ``/reset_prefix_cache`` →
``/update_weight_version`` → ``/resume``). The completions endpoint does not report the
weight version, so results are tagged client side: requests wait while an update runs,
then carry the version the client last loaded (``/weight_info`` shows the server's).

No in-memory sync here (``sync.method=distributed`` is refused for vLLM). vLLM does offer
one over HTTP, in dev mode with ``--weight-transfer-config '{"backend": "nccl"}'``:
``/init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
world_size}}``, ``/start_weight_update``, ``/update_weights {"update_info": {names,
dtype_names, shapes, packed}}``, ``/finish_weight_update``. Its data plane is vLLM's own
``StatelessProcessGroup`` rendezvous and ``PyNcclCommunicator`` (CUDA/ROCm), so the
trainer's end would be vLLM's ``NCCLWeightTransferEngine.trainer_init``: vLLM in the
trainer's environment and a GPU, neither of which this client can assume.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from tailcut.engine.base import EngineError
from tailcut.engine.http import ServerClient, ServerHTTPError, fan_out, prometheus_sum, sse_events
from tailcut.engine.remote import Flight, RemoteEngine
from tailcut.types import FinishReason, GenerateRequest, GenerateResult

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,
}

DEV_MODE_HINT = "start the server with VLLM_SERVER_DEV_MODE=1 to enable it"


def server_request_id(request_id: str) -> str:
    """The id vLLM's completions endpoint gives the (single) request it makes."""
    return f"cmpl-{request_id}-0"


class VLLMEngine(RemoteEngine):
    """Generate on vLLM servers; an abort closes the stream (and uses the abort endpoint
    where offered), then waits for /metrics to show the requests gone."""

    name = "vllm"
    health_path = "/health"
    close_on_abort = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.model: str | None = self.config.model_name
        self.use_abort_endpoint = True
        """Send ``/abort_requests`` where the server offers it (False: closing the stream
        is the only abort, as on servers without ``VLLM_SERVER_DEV_MODE``)."""
        self._dev: dict[str, bool] = {}

    async def _on_ready(self) -> None:
        if self.model is None:
            data = await self.servers[0].get_json("/v1/models", timeout_s=30.0)
            models = data.get("data") or []
            if not models:
                raise EngineError(f"vllm server {self.servers[0].url} serves no model (/v1/models)")
            self.model = str(models[0]["id"])
        dev = await fan_out(self._has_dev_endpoints(s) for s in self.servers)
        self._dev = {s.url: d for s, d in zip(self.servers, dev, strict=True)}

    async def _has_dev_endpoints(self, server: ServerClient) -> bool:
        """Whether ``/abort_requests`` is there: asked with an id no request has (a no-op),
        which also warms the route up before the first real abort needs it."""
        probe = {"request_ids": [server_request_id("tailcut-probe")]}
        try:
            await server.request("POST", "/abort_requests", json=probe, timeout_s=30.0, retries=0)
        except ServerHTTPError:
            return False
        return True

    def body(self, request: GenerateRequest) -> dict[str, Any]:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "ignore_eos": s.ignore_eos,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": True,
            "request_id": request.request_id,
        }
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed is not None:
            body["seed"] = s.stream_seed()
        if s.priority is not None:  # honoured by a server run with --scheduling-policy priority
            body["priority"] = s.priority
        return body

    async def _request(self, server: ServerClient, flight: Flight) -> GenerateResult:
        flight.weight_version = self.weight_version
        finish: str | None = None
        async with server.stream("/v1/completions", self.body(flight.request)) as resp:
            async for chunk in sse_events(resp):
                if "error" in chunk:
                    err = chunk["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise ServerHTTPError(server.url, "/v1/completions", resp.status, str(msg))
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                    flight.output_ids.extend(int(t) for t in ids)
                    flight.logprobs.extend(math.nan if x is None else float(x) for x in lps)
                    finish = choice.get("finish_reason") or finish
        reason = _FINISH.get(finish or "")
        if reason is None:
            raise EngineError(
                f"vllm server {server.url} ended {flight.rid} with finish reason {finish!r} "
                f"after {len(flight.output_ids)} token(s)"
            )
        if reason is FinishReason.ABORT and not flight.abort_sent:
            raise EngineError(f"vllm server {server.url} aborted {flight.rid} on its own")
        aligned = len(flight.logprobs) == len(flight.output_ids)
        return GenerateResult(
            request_id=flight.rid,
            output_ids=list(flight.output_ids),
            finish_reason=reason,
            logprobs=list(flight.logprobs) if aligned else None,
            weight_version=self.weight_version
            if flight.weight_version is None
            else flight.weight_version,
            prompt_tokens=len(flight.request.prompt_ids),
        )

    # -- abort and load ----------------------------------------------------------------

    async def _send_abort(
        self, server: ServerClient, request_ids: list[str], within_s: float
    ) -> None:
        if self.use_abort_endpoint and self._dev.get(server.url):
            ids = [server_request_id(r) for r in request_ids]
            await server.request(
                "POST", "/abort_requests", json={"request_ids": ids}, timeout_s=within_s, retries=0
            )
        # Closing the stream (done by the caller for vLLM) is the abort everywhere else.

    async def _send_abort_all(self, server: ServerClient) -> None:
        if self._dev.get(server.url):
            await server.request("POST", "/abort_requests", json={}, timeout_s=10.0)

    async def _load(self, server: ServerClient) -> tuple[int, int] | None:
        text = (await server.request("GET", "/metrics", timeout_s=5.0, retries=0)).text
        running = prometheus_sum(text, "vllm:num_requests_running")
        waiting = prometheus_sum(text, "vllm:num_requests_waiting")
        if running is None or waiting is None:
            return None
        return int(running), int(waiting)

    async def counters(self) -> dict[str, float]:
        """Server-side counters summed over the servers (from /metrics): running, waiting,
        generation_tokens, prompt_tokens, preemptions."""
        names = {
            "running": "vllm:num_requests_running",
            "waiting": "vllm:num_requests_waiting",
            "generation_tokens": "vllm:generation_tokens_total",
            "prompt_tokens": "vllm:prompt_tokens_total",
            "preemptions": "vllm:num_preemptions_total",
        }
        texts = await self._each_server("GET", "/metrics", timeout_s=10.0)
        return {
            key: sum(prometheus_sum(str(t), metric) or 0.0 for t in texts)
            for key, metric in names.items()
        }

    # -- sleep, wake, weights (dev-mode endpoints) -------------------------------------

    async def _dev_call(self, method: str, path: str, **kw: Any) -> list[Any]:
        try:
            return await self._each_server(method, path, **kw)
        except ServerHTTPError as exc:
            if exc.status == 404:
                raise EngineError(f"vllm server {exc.url} has no {path}: {DEV_MODE_HINT}") from exc
            raise

    async def sleep(self, level: int = 1) -> None:
        """Put every server to sleep (level 1: offload weights, drop KV cache; level 2:
        drop both). In-flight requests are aborted by the server."""
        if level not in (1, 2):
            raise ValueError(f"vLLM sleep level must be 1 or 2, got {level}")
        await self._dev_call("POST", "/sleep", params={"level": str(level)})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every server (``tags``: ``weights``, ``kv_cache``; None: all)."""
        params = [("tags", t) for t in tags] if tags else None
        await self._dev_call("POST", "/wake_up", params=params)

    async def is_sleeping(self) -> list[bool]:
        return [bool(a.get("is_sleeping")) for a in await self._dev_call("GET", "/is_sleeping")]

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | None = None,
        *,
        abort_in_flight: bool = False,
        check_path: bool = True,
    ) -> None:
        """Reload the weights in ``model_path`` on every server (dev mode), in place: the
        directory must hold weights of the served architecture. vLLM's engine core dies
        on a reload that fails (a directory without weight files, or weights that do not
        fit), and the server must then be restarted; so ``check_path`` first makes sure,
        here, that the directory has ``config.json`` and ``*.safetensors`` / ``*.bin``
        files (turn it off only when the servers see a path this process cannot). See
        :meth:`RemoteEngine.update_weights_from_disk`."""
        if check_path:
            problem = await asyncio.to_thread(_weights_problem, Path(model_path))
            if problem:
                raise EngineError(
                    f"vllm: not loading weights from {model_path}: {problem} (a failed reload "
                    f"kills vLLM's engine core)"
                )
        await super().update_weights_from_disk(
            model_path, weight_version, abort_in_flight=abort_in_flight
        )

    async def _load_weights(self, server: ServerClient, model_path: str, version: int) -> None:
        """``/pause?mode=wait`` (running requests finish; new ones queue in the server) →
        ``/collective_rpc`` ``reload_weights(weights_path=…)`` (every worker reads the
        directory in place) → ``/reset_prefix_cache`` → ``/update_weight_version`` →
        ``/resume`` (also after a failure, so the server does not stay paused)."""
        await self._dev_on(server, "POST", "/pause", params={"mode": "wait"})
        try:
            await self._dev_on(
                server,
                "POST",
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": model_path}},
            )
            await self._dev_on(server, "POST", "/reset_prefix_cache")
            await self._dev_on(
                server, "POST", "/update_weight_version", json={"new_version": str(version)}
            )
        finally:
            await self._dev_on(server, "POST", "/resume")

    async def _dev_on(self, server: ServerClient, method: str, path: str, **kw: Any) -> None:
        kw.setdefault("timeout_s", self.config.control_timeout_s)
        try:
            await server.request(method, path, **kw)
        except ServerHTTPError as exc:
            if exc.status == 404:
                raise EngineError(
                    f"vllm server {server.url} has no {path}, which loading weights needs: "
                    f"{DEV_MODE_HINT}"
                ) from exc
            raise

    async def weight_versions(self) -> list[str]:
        """The weight version each server reports (``GET /weight_info``; dev mode)."""
        answers = await self._dev_call("GET", "/weight_info", timeout_s=10.0)
        return [str(a.get("weight_version")) for a in answers]


def _weights_problem(path: Path) -> str | None:
    """What makes ``path`` unfit for a reload (None: it looks like a model directory)."""
    if not path.is_dir():
        return "no such directory"
    if not (path / "config.json").is_file():
        return "no config.json in it"
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return "no *.safetensors or *.bin weight files in it"
    return None
