"""The serving engine: continuous batching over a paged KV cache.

    engine = Engine(model, EngineSettings(...), tokenizer=tok)
    engine.submit(prompt_ids, SamplingParams(...), on_output=callback)   # any thread
    while engine.has_work(): engine.step()                               # one thread

Each `step` runs the model once on every running request together (trireme.inference.scheduler
picks them: one decode token per request with its prompt cached, plus prompt chunks), as one
ragged batch [1, T] over the paged cache (trireme.models.paged), samples one token for each
request whose row ends its known tokens, and hands each request its new text through
`on_output` (also returned). Per step there is one host sync: the sampled ids (and whether each
row's logits were finite) come back to the CPU together. A vision model's request may carry
images: the prompt chunks holding their placeholders get their features (trireme.inference.images).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from trireme.data.tokenizer_base import Tokenizer
from trireme.errors import TriremeError
from trireme.inference.blocks import BlockAllocator, pool_blocks
from trireme.inference.graphs import DecodeGraphs, graphs_supported
from trireme.inference.images import RequestImages
from trireme.inference.sampling import SamplingParams, request_generator, sample_rows
from trireme.inference.scheduler import Request, RequestOutput, Scheduler, StepPlan
from trireme.inference.text import TextStream
from trireme.models.gpt import GPT
from trireme.models.paged import PagedCache, PagedLayout, PagedStep
from trireme.models.vision import ImageRows, num_image_tokens


class RequestError(TriremeError):
    """A request the engine cannot take (an HTTP 400)."""


class QueueFull(TriremeError):
    """The waiting queue is full (an HTTP 429)."""


@dataclass
class EngineSettings:
    """block_size: positions per KV block; num_blocks / max_memory_gib: the pool's size (else
    from free GPU memory, or on the CPU enough for max_running full contexts, up to 1 GiB);
    max_running: requests decoded together; max_batch_tokens: tokens per step (decode + prompt
    chunks); max_queue: waiting requests before `submit` raises QueueFull; seed: the shared
    sampler's; cuda_graphs: replay decode-only steps as CUDA graphs (trireme.inference.graphs);
    compile_decode: with cuda_graphs, capture a torch.compile'd decode forward
    (trireme.inference.compiled_decode)."""

    block_size: int = 16
    num_blocks: int = 0
    max_memory_gib: float = 0.0
    max_running: int = 64
    max_batch_tokens: int = 512
    max_queue: int = 256
    seed: int = 0
    cuda_graphs: bool = False
    compile_decode: bool = True

    def check(self) -> None:
        for name in ("block_size", "max_running", "max_batch_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise TriremeError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_blocks < 0 or self.max_memory_gib < 0:
            raise TriremeError("num_blocks and max_memory_gib must not be negative")


class Engine:
    """Continuous batching for one model (module docstring). `tokenizer` turns outputs into
    text and enables stop strings; `eos_id` ends a request (default: the tokenizer's eod)."""

    def __init__(self, model: GPT, settings: EngineSettings | None = None, *,
                 tokenizer: Tokenizer | None = None, eos_id: int | None = None) -> None:
        self.settings = settings = settings or EngineSettings()
        settings.check()
        self.model = model.eval()
        self.cfg = model.cfg
        weight = model.embedding.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.tokenizer = tokenizer
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eod if tokenizer else None)
        probe = PagedCache(model, PagedLayout(1, settings.block_size), 1, torch.device("meta"),
                           self.dtype)  # bytes of one block, allocating nothing
        num_blocks = pool_blocks(
            max(probe.nbytes(), 1), num_blocks=settings.num_blocks,
            max_memory_gib=settings.max_memory_gib, device=self.device,
            fallback_tokens=settings.max_running * self.cfg.seq_length,
            block_size=settings.block_size, context_tokens=self.cfg.seq_length)
        self.allocator = BlockAllocator(num_blocks)
        self.cache = PagedCache(model, PagedLayout(num_blocks, settings.block_size),
                                settings.max_running, self.device, self.dtype)
        self.scheduler = Scheduler(self.allocator, settings.block_size, settings.max_running,
                                   settings.max_batch_tokens, settings.max_queue)
        self.generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        self.graphs = None
        if settings.cuda_graphs and graphs_supported(model, self.cache, settings.block_size):
            self.graphs = DecodeGraphs(model, self.cache, settings.max_running,
                                       settings.block_size, compile=settings.compile_decode)
            with torch.inference_mode():
                self.graphs.capture_all()
        self.lock = threading.Lock()  # submit / cancel (any thread) against step (one thread)
        self.to_cancel: set[str] = set()
        self.ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "requests_finished": 0}

    # ------------------------------------------------------------------ requests in and out

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise RequestError if the prompt cannot run (empty, too long, ids out of range)."""
        if not prompt_ids:
            raise RequestError("the prompt has no tokens")
        limit = self.cfg.seq_length
        if len(prompt_ids) >= limit:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the model's context "
                               f"is {limit} (prompt + at least 1 new token); shorten the prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.cfg.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output=None,
               request_id: str | None = None, images: torch.Tensor | None = None) -> Request:
        """Queue a request; raises RequestError (bad request) or QueueFull. `images` [k, 3, S,
        S] (normalized pixels, a vision model): their features fill the prompt's placeholders."""
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
                               "server more --max-memory")
        with self.lock:
            if len(self.scheduler.waiting) >= self.settings.max_queue:
                raise QueueFull(f"the queue holds {self.settings.max_queue} waiting requests "
                                "(--max-queue); retry later")
            self.scheduler.waiting.append(request)
        return request

    def _request_images(self, prompt_ids: list[int], images: torch.Tensor | None
                        ) -> RequestImages | None:
        """The request's images with their placeholder positions (RequestError if they do not
        fit the model or the prompt)."""
        if images is None:
            return None
        cfg = self.cfg
        if not cfg.vision_layers:
            raise RequestError("this model takes no images (model.vision_layers = 0)")
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
            return bool(self.scheduler.waiting or self.scheduler.running or self.to_cancel)

    def stats(self) -> dict[str, int]:
        """Queue length, running requests, KV blocks used / total, and the counters."""
        with self.lock:
            return {"waiting": len(self.scheduler.waiting),
                    "running": len(self.scheduler.running),
                    "kv_blocks_used": self.allocator.used,
                    "kv_blocks_total": self.allocator.usable, **self.counters}

    # ------------------------------------------------------------------ stepping

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One forward over every running request (module docstring); the outputs it made."""
        with self.lock:
            outputs = self._cancel_requested()
            self.scheduler.admit()
            plan = self.scheduler.plan()
        if plan.num_tokens == 0:
            return outputs
        ids, positions, step, output_index, sampled = self._batch(plan)
        image_rows = self._image_rows(plan)
        logits = None  # [n, vocab]
        if self.graphs is not None and not plan.prefills:
            logits = self.graphs.run(ids, positions, step)
        if logits is None:
            self.cache.begin(step)
            logits = self.model(ids.unsqueeze(0), kv_cache=self.cache,
                                position_ids=positions.unsqueeze(0),
                                output_index=output_index, image_rows=image_rows)[0]
        next_ids = sample_rows(logits, [r.params for r in sampled],
                               [r.generator for r in sampled], self.generator)
        finite = torch.isfinite(logits).all(dim=-1)
        tokens, ok = torch.stack([next_ids, finite.long()]).tolist()  # the step's one sync
        for request in plan.decodes:
            request.num_cached += 1
        for request, count in plan.prefills:
            request.num_cached += count
            self.counters["prompt_tokens"] += count
            if not request.prefilling:
                request.images = None  # its features are in the cache now
        with self.lock:
            for request, token, good in zip(sampled, tokens, ok):
                outputs.append(self._take_token(request, token, bool(good)))
        self.counters["steps"] += 1
        return outputs

    def _batch(self, plan: StepPlan):
        """Device tensors of the step: token ids [T], positions [T], the PagedStep, the rows
        whose logits are sampled [n], and the requests they belong to."""
        bs = self.settings.block_size
        ids, positions, slots, outputs, requests = [], [], [], [], []
        sampled: list[Request] = []

        def add(request: Request, start: int, count: int) -> None:
            requests.append((len(ids), count, request.slot, start))
            if count == 1:
                ids.append(request.token(start))
            else:  # a prompt chunk
                ids.extend(request.prompt_ids[start : start + count])
            blocks = request.blocks
            positions.extend(range(start, start + count))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + count))
            if start + count == request.num_tokens:  # its last known token: sample the next
                outputs.append(len(ids) - 1)
                sampled.append(request)

        for request in plan.decodes:
            add(request, request.num_cached, 1)
        n_dec = len(plan.decodes)
        width = max((-(-(r.num_cached + 1) // bs) for r in plan.decodes), default=0)
        tables = [r.blocks[:width] + [0] * (width - len(r.blocks[:width])) for r in plan.decodes]
        lengths = [r.num_cached + 1 for r in plan.decodes]
        chunks = []
        for request, count in plan.prefills:
            chunks.append((len(ids), count, request.num_cached))
            add(request, request.num_cached, count)
        prefill_tables = [plan.prefills[i][0].blocks[: -(-(start + count) // bs)]
                          for i, (_, count, start) in enumerate(chunks)]
        flat_tables = list(itertools.chain.from_iterable(tables))
        parts = [ids, positions, slots, outputs, flat_tables, lengths, *prefill_tables]
        flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long)
        if self.device.type == "cuda":
            flat = flat.pin_memory()
        pieces = flat.to(self.device, non_blocking=True).split([len(p) for p in parts])
        ids_t, pos_t, slots_t, out_t, tables_t, lengths_t = pieces[:6]
        step = PagedStep(
            slot_ids=slots_t, num_decode=n_dec, decode_tables=tables_t.view(n_dec, width),
            decode_lengths=lengths_t,
            prefills=[(first, count, table, start)
                      for (first, count, start), table in zip(chunks, pieces[6:])],
            requests=requests)
        return ids_t, pos_t, step, out_t, sampled

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
        elif token == self.eos_id and not request.params.ignore_eos:
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
