"""The embedded engine: an in-process Hugging Face causal LM with continuous batching.

:mod:`~tailcut.engine.hf.engine` holds :class:`HFEngine`, the engine contract's front end
on the event loop; :mod:`~tailcut.engine.hf.worker` the one worker thread that owns the
model and runs the batch; :mod:`~tailcut.engine.hf.step` one batched forward pass and the
sampling after it; :mod:`~tailcut.engine.hf.graphs` the decode pass from fixed buffers,
replayed from CUDA graphs; :mod:`~tailcut.engine.hf.cache` the per-slot KV cache;
:mod:`~tailcut.engine.hf.attention` the one attention function every family runs through
(registered with transformers' attention interface) and the masks it reads;
:mod:`~tailcut.engine.hf.support` which models the engine runs and why it refuses others;
:mod:`~tailcut.engine.hf.sampling` batched next-token sampling with
per-row temperature, top-p and random stream; :mod:`~tailcut.engine.hf.records` the
bookkeeping records (requests in flight, counters, hand-off of results to the event
loop); and :mod:`~tailcut.engine.hf.load` loading a model directory or a
randomly initialised Qwen2.
"""

from tailcut.engine.hf.engine import HFEngine

__all__ = ["HFEngine"]
