"""The engine on a thread of its own: it steps the model while there is work and sleeps when
there is none; HTTP handlers (on the event loop) submit requests and receive outputs through
callbacks. Also the numbers /metrics reports.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback

import torch

from trireme.serving.engine import Engine
from trireme.serving.sampling import SamplingParams
from trireme.serving.scheduler import Request

RATE_WINDOW_S = 10.0  # tokens/s is measured over this many seconds


class EngineThread:
    """Runs `engine.step()` in a loop on a daemon thread (start / shutdown)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.wake = threading.Event()
        self.stopping = False
        self.failed: str | None = None
        self.thread = threading.Thread(target=self._run, name="trireme-engine", daemon=True)
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output,
               images: torch.Tensor | None = None) -> Request:
        request = self.engine.submit(prompt_ids, params, on_output, images=images)
        self.wake.set()
        return request

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self.wake.set()

    def _run(self) -> None:
        while not self.stopping:
            if not self.engine.has_work():
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # a failed step (out of memory...) fails its requests, not us
                traceback.print_exc(file=sys.stderr)
                try:
                    self.engine.abort_all("error")
                except Exception:  # noqa: BLE001 - keep serving whatever a callback did
                    traceback.print_exc(file=sys.stderr)
            self._sample_rate()

    def _sample_rate(self) -> None:
        now = time.monotonic()
        self.samples.append((now, self.engine.counters["generation_tokens"]))
        while self.samples and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()

    def tokens_per_second(self) -> float:
        """Output tokens per second over the last RATE_WINDOW_S seconds (0 after that long
        without a step)."""
        now = time.monotonic()
        samples = [(t, count) for t, count in list(self.samples) if now - t <= RATE_WINDOW_S]
        if len(samples) < 2:
            return 0.0
        (first_time, first_count), last_count = samples[0], samples[-1][1]
        return (last_count - first_count) / max(now - first_time, 1e-3)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop stepping; requests still in the engine end as "cancelled"."""
        self.stopping = True
        self.wake.set()
        if self.thread.ident is not None:  # started (a server that failed to start did not)
            self.thread.join(timeout)
        self.engine.abort_all("cancelled")

    def metrics_text(self, model_name: str) -> str:
        """The Prometheus text exposition of the engine's state."""
        stats = self.engine.stats()
        rows = [
            ("queue_length", "gauge", "Requests waiting for a slot.", stats["waiting"]),
            ("running_requests", "gauge", "Requests being decoded.", stats["running"]),
            ("kv_blocks_used", "gauge", "KV cache blocks held by requests.",
             stats["kv_blocks_used"]),
            ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", stats["kv_blocks_total"]),
            ("output_tokens_per_second", "gauge",
             f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s.",
             round(self.tokens_per_second(), 3)),
            ("generation_tokens_total", "counter", "Tokens generated.",
             stats["generation_tokens"]),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", stats["prompt_tokens"]),
            ("requests_finished_total", "counter", "Requests finished (any reason).",
             stats["requests_finished"]),
            ("steps_total", "counter", "Engine steps (model forwards).", stats["steps"]),
        ]
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        label = f'{{model="{escaped}"}}'
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP trireme_{name} {help_text}", f"# TYPE trireme_{name} {kind}",
                      f"trireme_{name}{label} {value}"]
        return "\n".join(lines) + "\n"
