"""CUDA graphs for the engine's decode-only steps (EngineSettings.cuda_graphs).

A decode step of a 1B model launches a few hundred small kernels; launched one by one from
Python that takes longer than the GPU needs to read the weights. A CUDA graph replays them all at
once. A graph has fixed shapes and addresses, so:

- one graph per batch bucket (1, 2, 4, ... up to max_running): a step of n requests runs the
  smallest bucket >= n, the extra rows padded (token 0 at position 0, one key in block 0, which
  no request owns, written into its slot 0: harmless);
- the step's inputs are copied into static buffers (ids, positions, KV slots, block tables as
  wide as the longest context, lengths) before each replay; the paged decode kernel
  (trireme.ops.paged_attention_triton) reads each request's blocks only up to its length, so the
  wide tables cost nothing;
- only steps without prompt chunks replay (prefill shapes vary); those run eagerly (or
  compiled, with compile_prefill: trireme.serving.compiled_prefill).

With `compile` (EngineSettings.compile_decode: on by default with CUDA graphs) the captured
forward runs each block's pure pieces compiled, the KV store and the paged kernel eager between
them (trireme.serving.compiled_decode: Inductor fuses the elementwise kernels between the
GEMMs); the warm-up runs compile them, before the capture. If torch.compile is unavailable, or
compiling or capturing the compiled forward fails, the buckets from then on are captured from
the eager forward instead, with one warning; with `strict` (compile_decode explicitly on) that
raises a ConfigError instead.

Only with the Triton paged kernel (CUDA, power-of-two head and block sizes): the gather path
would gather the whole table. A model whose forward cannot be captured (a host sync inside, as in
some MoE dispatchers) falls back to eager steps with a warning. Sampling stays outside the graph.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import torch

from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.models.paged import PagedCache, PagedKV, PagedStep
from trireme.ops.paged_attention import kernel_available
from trireme.serving.compiled_decode import compile_decode, unavailable


def graphs_supported(model: GPT, cache: PagedCache, block_size: int) -> bool:
    """CUDA, the Triton paged kernel, and no per-request (SlotState) sublayer states."""
    cfg = model.cfg
    only_attention = all(isinstance(s, PagedKV) for s in cache.states())
    decode_auto = cfg.attention_backend in ("auto", "fa4")  # fa4 decodes on the auto path
    return (model.embedding.weight.is_cuda and decode_auto and only_attention
            and block_size & (block_size - 1) == 0 and cfg.head_size & (cfg.head_size - 1) == 0
            and kernel_available(cache.failures))


def first_line(e: Exception) -> str:
    """'Type: the first line of the message' (at most 200 characters)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def buckets_up_to(max_running: int) -> list[int]:
    sizes = [1 << i for i in range(max(max_running, 1).bit_length()) if 1 << i < max_running]
    return sizes + [max_running]


class DecodeGraphs:
    """The captured decode steps of one engine (module docstring)."""

    backend = "inductor"  # torch.compile's, for the compiled decode forward

    def __init__(self, model: GPT, cache: PagedCache, max_running: int, block_size: int,
                 compile: bool = False, strict: bool = False) -> None:
        self.model, self.cache = model, cache
        self.strict = strict  # compile_decode explicitly on: its failure raises
        self.compiled = False
        if compile:
            why = unavailable()
            if why is None:
                compile_decode(cache, self.backend)
                self.compiled = True
            else:
                self._compile_failed(why)
        device = model.embedding.weight.device
        self.width = math.ceil(model.cfg.seq_length / block_size)
        self.buckets = buckets_up_to(max_running)
        size = self.buckets[-1]
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.slots = torch.zeros(size, **long)
        self.tables = torch.zeros(size, self.width, **long)
        self.lengths = torch.ones(size, **long)
        self.rows = torch.arange(size, **long)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.keep: list[torch.cuda.CUDAGraph] = []
        self.pool = None
        self.broken = False
        self.warmup_s = 0.0  # seconds in the warm-up runs (with compile: mostly compiling)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, size: int) -> torch.Tensor:
        step = PagedStep(slot_ids=self.slots[:size], num_decode=size,
                         decode_tables=self.tables[:size], decode_lengths=self.lengths[:size])
        self.cache.begin(step)
        return self.model(self.ids[:size].unsqueeze(0), kv_cache=self.cache,
                          position_ids=self.positions[:size].unsqueeze(0),
                          output_index=self.rows[:size])[0]  # [size, vocab]

    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so the memory pool fits all)."""
        for size in reversed(self.buckets):
            if not self.broken:
                self._capture(size)

    def _capture(self, size: int) -> None:
        self._pad(0)
        try:
            self.graphs[size] = self._record(size)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
            if self.compiled:  # try once more with the eager blocks
                self._compile_failed(f"compiling or capturing it failed ({first_line(e)})", e)
                self.compiled, self.cache.compiled_layer = False, None
                return self._capture(size)
            warnings.warn(f"CUDA graphs are off for this model: capturing a decode step failed "
                          f"({first_line(e)})", stacklevel=2)
            self.broken = True
            self.graphs.clear()

    def _compile_failed(self, why: str, cause: Exception | None = None) -> None:
        """Warn (one line) that the eager forward is captured instead; raise when strict."""
        if self.strict:
            raise ConfigError(f"compile_decode is on (--compile-decode on) but {why}; use "
                              "--compile-decode auto (the eager forward then) or off") from cause
        warnings.warn(f"the compiled decode forward is off: {why}", stacklevel=3)

    def _record(self, size: int) -> tuple[Callable[[], None], torch.Tensor]:
        """(replay, the logits it refreshes) of one bucket, captured as a CUDA graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: allocator, Triton compilation, rope tables
                self._forward(size)
        side.synchronize()
        self.warmup_s += time.perf_counter() - start
        torch.cuda.current_stream().wait_stream(side)
        if not kernel_available(self.cache.failures):  # it failed in the warm-up (for this
            # engine): the gather path is no graph's
            raise RuntimeError("the paged decode kernel is unavailable")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size)
        self.pool = graph.pool()
        self.keep.append(graph)
        return graph.replay, logits

    def _pad(self, n: int) -> None:
        """Rows n.. of the static inputs: one key at position 0 in block 0."""
        self.ids[n:].zero_()
        self.positions[n:].zero_()
        self.slots[n:].zero_()
        self.tables[n:, 0].zero_()
        self.lengths[n:].fill_(1)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, step: PagedStep
            ) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode-only step by replaying its bucket's graph; None when
        there is no graph for it (the engine then runs the step eagerly)."""
        n = ids.shape[0]
        if self.broken or n > self.buckets[-1] or step.decode_tables.shape[1] > self.width:
            return None
        size = self.bucket(n)
        if size not in self.graphs:
            self._capture(size)
            if self.broken:
                return None
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(step.slot_ids)
        self.tables[:n, : step.decode_tables.shape[1]].copy_(step.decode_tables)
        self.lengths[:n].copy_(step.decode_lengths)
        self._pad(n)
        replay, logits = self.graphs[size]
        replay()
        return logits[:n]
