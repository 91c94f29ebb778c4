"""The serving engine: continuous batching over a paged KV cache.

    engine = Engine(model, EngineSettings(...), tokenizer=tok)
    engine.submit(prompt_ids, SamplingParams(...), on_output=callback)   # any thread
    while engine.has_work(): engine.step()                               # one thread

Each `step` runs the model once on every running request together (trireme.serving.scheduler
picks them: one decode token per request with its prompt cached, plus prompt chunks), as one
ragged batch [1, T] over the paged cache (trireme.models.paged), samples one token for each
request whose row ends its known tokens, and hands each request its new text through
`on_output` (also returned). Per step there is one host sync: the sampled ids (and whether each
row's logits were finite) come back to the CPU together. A vision model's request may carry
images: the prompt chunks holding their placeholders get their features (trireme.serving.images).

Overlap (EngineSettings.overlap, on with CUDA graphs): the host's work of a step (reading the
sampled ids, outputs, stop strings, planning) runs while the GPU computes the next one. A call
to `step` launches step N+1's forward with step N's sampled ids as its input (they stay on the
device), then waits for step N's ids, hands them out, and plans step N+1 exactly as the serial
engine would; the early forward is kept when the plan's requests are its requests (minus any that
ended at step N: their rows are dropped before sampling), else it is discarded and the plan runs
(a join, a prompt chunk, a cancellation). Sampling happens after the plan is known, in the
serial order, so every token (seeded, shared-generator or greedy) is the serial engine's; each
call returns the previous step's outputs. The serial path (overlap off) is the reference.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from trireme.data.tokenizer_base import Tokenizer
from trireme.errors import ConfigError, TriremeError
from trireme.models.gpt import GPT
from trireme.models.paged import PagedCache, PagedKV, PagedLayout
from trireme.models.vision import ImageRows, num_image_tokens
from trireme.ops import argmax, paged_attention, skinny_gemm
from trireme.ops.argmax import greedy_and_finite
from trireme.ops.kernel_settings import KernelFailures, KernelSettings, parse_paged_kernel
from trireme.ops.skinny_gemm import use_skinny_linears
from trireme.serving.blocks import BlockAllocator, pool_blocks
from trireme.serving.compiled_prefill import compile_prefill
from trireme.serving.graphs import DecodeGraphs, graphs_supported
from trireme.serving.images import RequestImages
from trireme.serving.sampling import SamplingParams, request_generator, sample_rows, seeded
from trireme.serving.scheduler import Request, RequestOutput, Scheduler, StepPlan
from trireme.serving.step_inputs import SlotTables, StepBatch
from trireme.serving.tensor_parallel import agreed_min
from trireme.serving.text import TextStream


class RequestError(TriremeError):
    """A request the engine cannot take (an HTTP 400); `param` names the request field at
    fault and `code` is the OpenAI error code, where there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None
                 ) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(TriremeError):
    """The waiting queue is full (an HTTP 429)."""


DECODE_GEMMS = ("cublas", "triton")  # EngineSettings.decode_gemm


@dataclass
class EngineSettings:
    """block_size: positions per KV block; num_blocks / max_memory_gib: the pool's size (else
    from free GPU memory, or on the CPU enough for max_running full contexts, up to 1 GiB);
    max_running: requests decoded together; max_batch_tokens: tokens per step (decode + prompt
    chunks); max_queue: waiting requests before `submit` raises QueueFull; seed: the shared
    sampler's (None: torch's default generator); cuda_graphs: replay decode-only steps as CUDA
    graphs (trireme.serving.graphs;
    None, the default: wherever they can run, i.e. graphs_supported: CUDA, the Triton kernel,
    attention-only models; True: the same; False: never); overlap: launch each decode step
    before reading the previous one's tokens (module docstring; None: on when CUDA graphs are);
    compile_decode: capture a torch.compile'd decode forward in the CUDA graphs
    (trireme.serving.compiled_decode; None: on when CUDA graphs are, falling back to the eager
    forward with a warning if compiling fails; True: that failure raises; True with cuda_graphs
    False is an error); compile_prefill: run the steps with prompt chunks through a
    torch.compile'd forward, T dynamic (trireme.serving.compiled_prefill; compiled at engine
    start; off by default until measured; if compiling fails, a ConfigError); decode_gemm:
    "triton" runs the linear layers of steps with at most 64 rows through the split-K kernel
    where it has a plan (trireme.ops.skinny_gemm: llama3-1b's down projection, and its gate-up
    projection with SwiGLU in one kernel; the default: measured faster at batch 64 on the H200
    than cuBLAS alone, bench/RESULTS.md), "cublas" through F.linear always; off sm_90
    GPUs, on the CPU or without Triton both are F.linear. The
    model's nn.Linear layers become SkinnyLinears (or back) in place, and stay so after the
    engine (they take the kernels only outside autograd). pdl, early_reads, paged_kernel: how
    the decode kernels launch (trireme.ops.kernel_settings.KernelSettings: programmatic
    dependent launch on sm_90, the early reads before its wait, the paged kernel's variant and
    launch settings); their defaults are the measured ones."""

    block_size: int = 16
    num_blocks: int = 0
    max_memory_gib: float = 0.0
    max_running: int = 64
    max_batch_tokens: int = 512
    max_queue: int = 256
    seed: int | None = 0
    cuda_graphs: bool | None = None
    overlap: bool | None = None
    compile_decode: bool | None = None
    compile_prefill: bool = False
    decode_gemm: str = "triton"
    pdl: bool = True
    early_reads: bool = True
    paged_kernel: str = "v2"

    def check(self) -> None:
        for name in ("block_size", "max_running", "max_batch_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise TriremeError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.decode_gemm not in DECODE_GEMMS:
            raise ConfigError(f"decode_gemm must be one of {', '.join(DECODE_GEMMS)}, got "
                              f"{self.decode_gemm!r}")
        if self.num_blocks < 0 or self.max_memory_gib < 0:
            raise TriremeError("num_blocks and max_memory_gib must not be negative")
        parse_paged_kernel(self.paged_kernel)  # a ConfigError now rather than at the first step
        if self.compile_decode and self.cuda_graphs is False:
            raise ConfigError("compile_decode on (--compile-decode on) is captured in the "
                              "decode CUDA graphs, which are off (--cuda-graphs off): turn them "
                              "on (auto), or use --compile-decode auto or off")

    def for_tensor_parallel(self) -> EngineSettings:
        """These settings for a tensor-parallel engine: its plain path (trireme.serving.
        tensor_parallel), graphs, overlap and compiled pieces off; a ConfigError if one of them
        was asked for."""
        asked = [name for name in ("cuda_graphs", "overlap", "compile_decode", "compile_prefill")
                 if getattr(self, name)]
        if asked:
            raise ConfigError(f"{', '.join(asked)} cannot run under tensor parallelism (torchrun "
                              "with several processes) yet; leave them at auto or off")
        return replace(self, cuda_graphs=False, overlap=False, compile_decode=False,
                       decode_gemm="cublas")

    def kernels(self) -> KernelSettings:
        """What the decode kernels are told (pdl, early_reads, paged_kernel)."""
        return KernelSettings(self.pdl, self.early_reads, self.paged_kernel)

    def compiles_decode(self) -> bool:
        """compile_decode resolved: auto (None) follows cuda_graphs (on unless they are off).
        The graphs themselves only apply where graphs_supported says (CUDA, the Triton kernel,
        no per-request states)."""
        if self.compile_decode is None:
            return self.cuda_graphs is not False
        return self.compile_decode


@dataclass
class Launched:
    """A step whose tokens are sampled on the device but maybe not yet read by the host."""

    sampled: list[Request]  # the requests of the sampled rows, in row order
    next_ids: torch.Tensor  # [n] on the device: the sampled ids
    host: torch.Tensor  # [2, n] ids and finite flags (pinned on a GPU, copied asynchronously)
    event: torch.cuda.Event | None  # recorded after the copy (None on the CPU)


@dataclass
class Ahead:
    """A forward launched before the previous step's tokens were read: its requests, in row
    order, and its logits [len(decodes), vocab]."""

    decodes: list[Request]
    logits: torch.Tensor

    def rows_for(self, plan: StepPlan) -> list[int] | None:
        """The rows of `plan`'s requests when the plan is these decodes or fewer; else None."""
        if plan.prefills:
            return None
        index = {id(r): i for i, r in enumerate(self.decodes)}
        rows = [index.get(id(r), -1) for r in plan.decodes]
        return None if -1 in rows else rows


class Engine:
    """Continuous batching for one model (module docstring). `tokenizer` turns outputs into
    text and enables stop strings; `eos_id` ends a request (default: the tokenizer's eod), and
    so does any of `stop_ids` (e.g. generation_config.json's end-of-turn ids)."""

    prefill_backend = "inductor"  # torch.compile's, for compile_prefill

    def __init__(self, model: GPT, settings: EngineSettings | None = None, *,
                 tokenizer: Tokenizer | None = None, eos_id: int | None = None,
                 stop_ids: tuple[int, ...] = ()) -> None:
        settings = settings or EngineSettings()
        settings.check()
        self.group = model.ctx.group("tensor")  # tensor-parallel: the ranks that step together
        if self.group is not None:
            settings = settings.for_tensor_parallel()
        self.settings = settings
        self.model = model.eval()
        self.cfg = model.cfg
        weight = model.embedding.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.kernels = settings.kernels()
        self.kernel_failures = KernelFailures()  # this engine's: no other engine's fallback
        self.use_decode_gemm(settings.decode_gemm)
        self.tokenizer = tokenizer
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eod if tokenizer else None)
        self.stop_ids = frozenset(stop_ids) | ({self.eos_id} if self.eos_id is not None else set())
        probe = PagedCache(model, PagedLayout(1, settings.block_size), 1, torch.device("meta"),
                           self.dtype)  # bytes of one block, allocating nothing
        num_blocks = pool_blocks(
            max(probe.nbytes(), 1), num_blocks=settings.num_blocks,
            max_memory_gib=settings.max_memory_gib, device=self.device,
            fallback_tokens=settings.max_running * self.cfg.seq_length,
            block_size=settings.block_size, context_tokens=self.cfg.seq_length)
        num_blocks = agreed_min(num_blocks, self.group, self.device)  # the same pool everywhere
        self.allocator = BlockAllocator(num_blocks)
        self.cache = PagedCache(model, PagedLayout(num_blocks, settings.block_size),
                                settings.max_running, self.device, self.dtype, self.kernels,
                                self.kernel_failures)
        self.scheduler = Scheduler(self.allocator, settings.block_size, settings.max_running,
                                   settings.max_batch_tokens, settings.max_queue)
        self.generator = None if settings.seed is None else seeded(settings.seed, self.device)
        self.graphs = None
        if (settings.cuda_graphs is not False
                and graphs_supported(model, self.cache, settings.block_size)):
            self.graphs = DecodeGraphs(model, self.cache, settings.max_running,
                                       settings.block_size, compile=settings.compiles_decode(),
                                       strict=settings.compile_decode is True)
            with torch.inference_mode():
                self.graphs.capture_all()
        self.prefill_compile_s = 0.0  # compile_prefill: seconds compiling at startup
        if settings.compile_prefill:
            with torch.inference_mode():  # the steps' mode: the compiled guards check it
                self.prefill_compile_s = compile_prefill(
                    model, self.cache, settings.max_batch_tokens, self.prefill_backend)
        # an early forward that is discarded must leave no trace: only key/value writes, which
        # the forward that replaces it rewrites (per-request recurrent states would advance)
        self.only_attention = all(isinstance(s, PagedKV) for s in self.cache.states())
        self.slot_tables = SlotTables(settings.max_running, self.cfg.seq_length,
                                      settings.block_size, self.device,
                                      slot_states=not self.only_attention)
        self.pending: Launched | None = None  # overlap: the launched step not yet read
        self.set_overlap(self.graphs is not None if settings.overlap is None
                         else settings.overlap)
        self.ahead = {"launched": 0, "used": 0, "discarded": 0, "trimmed": 0}
        self.waited_s = 0.0
        # submit / cancel (any thread, or an on_output callback) against step (one thread)
        self.lock = threading.RLock()
        self.to_cancel: set[str] = set()
        self.ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "requests_finished": 0}
        self.warm_kernels()
        self.freeze_startup_objects()

    def use_decode_gemm(self, choice: str) -> None:
        """The split-K kernel's layers (trireme.ops.skinny_gemm) where they run and `choice` is
        "triton", compiled now, before any graph captures them; else, with "cublas", or if a
        kernel fails to compile here (a warning says why), the plain layers again."""
        on = choice == "triton" and skinny_gemm.unavailable(self.device) is None
        use_skinny_linears(self.model, on=on, kernels=self.kernels)
        if not on:
            return
        try:
            skinny_gemm.warm_up(self.model)
        except Exception as e:  # noqa: BLE001 - a Triton compile error: serve without it
            use_skinny_linears(self.model, on=False)
            warnings.warn(f"the split-K decode kernel does not compile here ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}); the decode steps' linear layers "
                          "run through cuBLAS (EngineSettings.decode_gemm \"cublas\")",
                          stacklevel=3)

    def freeze_startup_objects(self) -> None:
        """On CUDA: collect once, then move every object alive now (the model, the compiled
        graphs and CUDA graphs built above: millions of objects) out of reach of Python's cycle
        collector (gc.freeze, process-wide). A full collection walks all of them, a long pause
        with millions of objects, and on the H200 serving runs met stalls in steps that did no
        more work than their neighbours. Frozen
        objects are still freed by reference counting; only cycles among them are kept. Not on
        the CPU, where no graphs are built (and tests build many engines in one process)."""
        if self.device.type != "cuda":
            return
        gc.collect()
        gc.freeze()

    def warm_kernels(self) -> None:
        """Compile now (CUDA only) the Triton kernels the steps outside the CUDA graphs launch:
        the greedy / finite kernel for the model's logits and the paged decode kernel at every
        split count (with its fused store too when no graphs replay the decode-only steps).
        A step that met one uncompiled stalled the engine for its compile, and on a fresh machine
        (an empty Triton cache) the first minutes of serving met several; it costs a few
        seconds at startup instead (cached on disk by Triton after the first time)."""
        if self.device.type != "cuda":
            return
        argmax.warm_up(self.cfg.vocab_size, self.model.padded_vocab_size, self.dtype,
                       self.device, self.kernels)
        kv = next((s for s in self.cache.states() if isinstance(s, PagedKV)), None)
        if kv is not None:
            heads = self.cfg.num_attention_heads // self.model.ctx.size("tensor")  # this rank's
            paged_attention.warm_up(kv.k_pool, kv.v_pool, heads,
                                    width=1, store=self.graphs is None, kernels=self.kernels)

    # ------------------------------------------------------------------ requests in and out

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise RequestError if the prompt cannot run (empty, too long, ids out of range)."""
        if not prompt_ids:
            raise RequestError("the prompt has no tokens", "prompt")
        limit = self.cfg.seq_length
        if len(prompt_ids) >= limit:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the model's context "
                               f"is {limit} (prompt + at least 1 new token); shorten the prompt",
                               "prompt", "context_length_exceeded")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.cfg.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size})",
                               "prompt")

    def room(self, prompt_tokens: int) -> int:
        """New tokens a request with a prompt this long can get at most: what the context and
        the whole KV pool hold after the prompt (<= 0: none)."""
        pool = self.allocator.usable * self.settings.block_size
        return min(self.cfg.seq_length, pool) - prompt_tokens

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output=None,
               request_id: str | None = None, images: torch.Tensor | None = None) -> Request:
        """Queue a request; raises RequestError (bad request) or QueueFull. `images` [k, 3, S,
        S] (normalized pixels, a vision model): their features fill the prompt's placeholders."""
        request = self.new_request(prompt_ids, params, on_output, request_id, images)
        self.enqueue(request)
        return request

    def enqueue(self, request: Request) -> None:
        """Append a checked request to the waiting queue (QueueFull when it holds max_queue);
        any thread."""
        with self.lock:
            self.check_queue()
            self.scheduler.waiting.append(request)

    def check_queue(self, waiting_elsewhere: int = 0) -> None:
        """QueueFull if the waiting queue, with `waiting_elsewhere` requests bound for it (a
        tensor-parallel server's inbox), holds max_queue."""
        if len(self.scheduler.waiting) + waiting_elsewhere >= self.settings.max_queue:
            raise QueueFull(f"the queue holds {self.settings.max_queue} waiting requests "
                            "(--max-queue); retry later")

    def new_request(self, prompt_ids: list[int], params: SamplingParams, on_output=None,
                    request_id: str | None = None, images: torch.Tensor | None = None
                    ) -> Request:
        """A checked Request, not queued yet (RequestError if it cannot run here)."""
        self.check_prompt(prompt_ids)
        request_images = self._request_images(prompt_ids, images)
        problem = params.problem()
        if problem:
            raise RequestError(problem)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer")
        max_len = min(len(prompt_ids) + params.max_tokens, self.cfg.seq_length)
        request = Request(
            request_id if request_id is not None else f"req-{next(self.ids)}",
            list(prompt_ids), params, max_len, on_output,
            TextStream(self.tokenizer, params.stop) if self.tokenizer else None,
            request_generator(params, self.device), images=request_images)
        need = self.scheduler.blocks_needed(request)
        if need > self.allocator.usable:
            raise RequestError(f"the request needs {need} KV blocks ({max_len} tokens) but the "
                               f"cache has {self.allocator.usable}; lower max_tokens or give the "
                               "server more --max-memory", "max_tokens")
        return request

    def _request_images(self, prompt_ids: list[int], images: torch.Tensor | None
                        ) -> RequestImages | None:
        """The request's images with their placeholder positions (RequestError if they do not
        fit the model or the prompt)."""
        if images is None:
            return None
        cfg = self.cfg
        if not cfg.vision_layers:
            raise RequestError("this model takes no images (model.vision_layers = 0)", "messages")
        size = cfg.vision_image_size
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, size, size):
            raise RequestError(f"images must be [k, 3, {size}, {size}], got {list(images.shape)}")
        positions = [i for i, t in enumerate(prompt_ids) if t == cfg.image_token_id]
        want = images.shape[0] * num_image_tokens(cfg)
        if len(positions) != want:
            raise RequestError(f"the prompt has {len(positions)} image placeholder tokens; "
                               f"{images.shape[0]} image(s) take {want}")
        return RequestImages(images, positions)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step (its blocks go back); any thread."""
        with self.lock:
            self.to_cancel.add(request_id)

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.scheduler.waiting or self.scheduler.running or self.to_cancel
                        or self.pending)

    def stats(self) -> dict[str, int]:
        """Queue length, running requests, KV blocks used / total, and the counters."""
        with self.lock:
            return {"waiting": len(self.scheduler.waiting),
                    "running": len(self.scheduler.running),
                    "kv_blocks_used": self.allocator.used,
                    "kv_blocks_total": self.allocator.usable, **self.counters}

    # ------------------------------------------------------------------ stepping

    def set_overlap(self, on: bool) -> list[RequestOutput]:
        """Turn overlap on or off between steps; turning it off reads the launched step (its
        outputs are returned)."""
        outputs = []
        if not on and self.pending is not None:
            with torch.inference_mode():
                outputs = self._read(self.pending)
            self.pending = None
        self.overlap = on
        self.can_launch_ahead = on and self.only_attention
        return outputs

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One forward over every running request (module docstring); the outputs it made (with
        overlap: the outputs of the step launched by the previous call)."""
        if self.overlap:
            return self._overlapped_step()
        with self.lock:
            outputs = self._cancel_requested()
            plan = self._plan()
        if plan.num_tokens == 0:
            return outputs
        return outputs + self._read(self._launch(plan))

    def _overlapped_step(self) -> list[RequestOutput]:
        """Launch step N+1's forward (from step N's samples, still on the device) before reading
        step N's tokens; then read them, plan N+1 as the serial engine would, and keep the early
        forward if its requests cover that plan (else run the plan's own forward)."""
        previous, self.pending = self.pending, None
        ahead = self._launch_ahead(previous) if previous is not None else None
        outputs = self._read(previous) if previous is not None else []
        with self.lock:
            outputs += self._cancel_requested()
            plan = self._plan()
        rows = ahead.rows_for(plan) if ahead is not None else None
        if plan.num_tokens == 0:
            pass
        elif rows is None:
            self.pending = self._launch(plan)
        else:
            logits = ahead.logits
            if rows != list(range(len(ahead.decodes))):  # some requests ended at step N
                logits = logits.index_select(0, self.slot_tables.to_device(rows))
                self.ahead["trimmed"] += 1
            self._commit(plan)
            self.pending = self._sample(plan.decodes, logits)
        if ahead is not None:
            self.ahead["used" if rows is not None and plan.num_tokens else "discarded"] += 1
        return outputs

    def _launch_ahead(self, previous: Launched) -> Ahead | None:
        """Step N+1's forward for the requests sampled at step N (in the running order, as the
        scheduler will plan them), or None when its plan will differ: a prompt is still being
        prefilled, a cancellation waits, or a waiting request will be admitted. Requests whose
        last token (max_len) is step N's are left out; a request that ends at step N by eos /
        a stop string is still in it (its row is dropped: its key and value land in its own
        blocks, reserved for max_len; the blocks go back after step N is read, and any later
        step that reuses them runs after this one on the stream)."""
        sampled = previous.sampled
        if not self.can_launch_ahead:
            return None
        with self.lock:
            running = self.scheduler.running
            if self.to_cancel or len(running) != len(sampled):
                return None  # (a running request that was not sampled is still prefilling)
            row = {id(r): i for i, r in enumerate(sampled)}
            order = [row.get(id(r), -1) for r in running]
            ending = {i for i, r in enumerate(sampled) if r.num_tokens + 1 >= r.max_len}
            if -1 in order or self.scheduler.waiting and (ending or self.scheduler.can_admit()):
                return None
        keep = [i for i in order if i not in ending]
        if not keep:
            return None
        ids = previous.next_ids  # [n]: step N's samples
        if keep != list(range(len(sampled))):
            ids = ids.index_select(0, self.slot_tables.to_device(keep))
        plan = StepPlan([sampled[i] for i in keep], [])
        logits = self._forward(plan, self.slot_tables.build(plan, decode_ids=ids))
        self.ahead["launched"] += 1
        return Ahead(plan.decodes, logits)

    def _plan(self) -> StepPlan:
        """Admit what fits (writing the new requests' block tables), then plan; under the lock."""
        self.slot_tables.assign(self.scheduler.admit())
        return self.scheduler.plan()

    def _batch(self, plan: StepPlan) -> StepBatch:
        """The step's device tensors (trireme.serving.step_inputs)."""
        return self.slot_tables.build(plan)

    def _launch(self, plan: StepPlan) -> Launched:
        batch = self._batch(plan)
        logits = self._forward(plan, batch)
        self._commit(plan)
        return self._sample(batch.sampled, logits)

    def _forward(self, plan: StepPlan, batch: StepBatch) -> torch.Tensor:
        """Logits [n, vocab] of the sampled rows: a graph replay for decode-only steps."""
        logits = None
        if self.graphs is not None and not plan.prefills:
            logits = self.graphs.run(batch.ids, batch.positions, batch.step)
        if logits is None:
            self.cache.begin(batch.step)
            logits = self.model(batch.ids.unsqueeze(0), kv_cache=self.cache,
                                position_ids=batch.positions.unsqueeze(0),
                                output_index=batch.output_index,
                                image_rows=self._image_rows(plan))[0]
        return logits

    def _commit(self, plan: StepPlan) -> None:
        """The plan's keys and values are (being) written: count them as cached."""
        for request in plan.decodes:
            request.num_cached += 1
        for request, count in plan.prefills:
            request.num_cached += count
            self.counters["prompt_tokens"] += count
            if not request.prefilling:
                request.images = None  # its features are in the cache now
        self.counters["steps"] += 1

    def _sample(self, sampled: list[Request], logits: torch.Tensor) -> Launched:
        """Sample the rows on the device and start copying the ids (and whether each row's
        logits were finite) to the host; nothing waits here."""
        both = greedy_and_finite(logits, kernels=self.kernels,  # [2, n]: argmax ids, finite
                                 failures=self.kernel_failures)  # flags (one read)
        next_ids = sample_rows(logits, [r.params for r in sampled],
                               [r.generator for r in sampled], self.generator, greedy=both[0])
        if not all(r.params.is_greedy for r in sampled):  # some rows drew their ids
            both = torch.stack([next_ids, both[1]])  # [2, n]
        if self.group is not None:  # every rank takes the first rank's ids
            both = both.contiguous()
            dist.broadcast(both, src=dist.get_global_rank(self.group, 0), group=self.group)
            next_ids = both[0]
        event = None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = both
        return Launched(sampled, next_ids, host, event)

    def _read(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens (the step's one host sync) and hand them out."""
        if launched.event is not None:
            start = time.perf_counter()
            launched.event.synchronize()
            self.waited_s += time.perf_counter() - start  # the host idle, waiting for the GPU
        tokens, ok = launched.host.tolist()
        outputs = []
        with self.lock:
            for request, token, good in zip(launched.sampled, tokens, ok):
                if request.finish_reason is None:
                    outputs.append(self._take_token(request, token, bool(good)))
        return outputs

    def _image_rows(self, plan: StepPlan) -> ImageRows | None:
        """The image features of the placeholders in this step's prompt chunks, at their rows
        of the packed batch (the chunks follow the decode rows, in plan order)."""
        first, index, features = len(plan.decodes), [], []
        for request, count in plan.prefills:
            if request.images is not None:
                offsets, rows = request.images.chunk(self.model, request.num_cached, count)
                index += [first + offset for offset in offsets]
                features.append(rows)
            first += count
        if not index:
            return None
        return ImageRows(torch.tensor(index, device=self.device), torch.cat(features))

    def _take_token(self, request: Request, token: int, finite: bool) -> RequestOutput:
        """Append a sampled token; finish the request on eos, a stop string or its length."""
        request.output_ids.append(token)
        self.counters["generation_tokens"] += 1
        if request.first_token_at is None:
            request.first_token_at = time.monotonic()
        reason = None
        if not finite:
            reason = "error"  # the model's logits were NaN / inf: nothing sensible to sample
        elif token in self.stop_ids and not request.params.ignore_eos:
            reason = "stop"
        elif request.text is not None:
            request.text.add(token)
            reason = "stop" if request.text.stopped else None
        if reason is None and request.num_tokens >= request.max_len:
            reason = "length"
        return self._output(request, [token], reason)

    def _output(self, request: Request, new_ids: list[int], reason: str | None) -> RequestOutput:
        if reason is not None:
            request.finish_reason = reason
            if request.text is not None:
                request.text.finish()
            self.scheduler.release(request)
            self.counters["requests_finished"] += 1
        text = request.text.delta() if request.text is not None else ""
        out = RequestOutput(request.request_id, text, new_ids, reason is not None, reason,
                            len(request.prompt_ids), len(request.output_ids))
        if request.on_output is not None:
            request.on_output(out)
        return out

    def abort_all(self, reason: str) -> None:
        """End every waiting and running request with `reason` (a failed step, shutdown)."""
        with self.lock:
            self.pending = None  # its tokens are dropped with their requests
            for request in [*self.scheduler.waiting, *self.scheduler.running]:
                self._output(request, [], reason)
            self.to_cancel.clear()

    def _cancel_requested(self) -> list[RequestOutput]:
        if not self.to_cancel:
            return []
        outputs = []
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            if request.request_id in self.to_cancel:
                outputs.append(self._output(request, [], "cancelled"))
        self.to_cancel.clear()
        return outputs

    # ------------------------------------------------------------------ offline use

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]
                 ) -> list[Request]:
        """Run every prompt to the end (offline batch mode); the finished requests, in order.
        Prompts beyond the queue bound wait outside it."""
        pending = list(zip(prompts, params))[::-1]
        done: list[Request] = []
        while pending or self.has_work():
            while pending and len(self.scheduler.waiting) < self.settings.max_queue:
                done.append(self.submit(*pending.pop()))
            self.step()
        return done
