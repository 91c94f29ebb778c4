"""`trireme serve` under torchrun: one serving engine per tensor-parallel rank, in lockstep.

Every rank holds its shard of the model and its own engine (trireme.serving.tensor_parallel:
the same pool size, the same sampled ids). Rank 0 runs the HTTP server; its handlers' requests
and cancellations do not touch its engine directly but wait in an inbox. At each step boundary
(`Leader.has_work`, which the engine thread calls before every step and every half second when
idle) rank 0 broadcasts the inbox as one JSON message, and every rank applies it to its engine in
the same order; each engine is then in the same state, so all of them step (or not) together
and their collectives meet. The other ranks run `follow` until rank 0 says stop.

    message = {"submit": [[request_id, prompt_ids, sampling settings], ...],
               "cancel": [request_id, ...], "stop": bool}

sent as its length, then its UTF-8 bytes (uint8 tensors; on the device for NCCL). An idle
server sends an empty message every half second, so the other ranks never wait long enough in
a collective to time out. Images (vision models) are refused here for now.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from trireme.serving.engine import Engine, RequestError
from trireme.serving.sampling import SamplingParams
from trireme.serving.scheduler import Request


def _send(message: dict, group: dist.ProcessGroup, device: torch.device) -> None:
    data = json.dumps(message).encode()
    length = torch.tensor([len(data)], dtype=torch.long, device=device)
    source = dist.get_global_rank(group, 0)
    dist.broadcast(length, src=source, group=group)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    dist.broadcast(payload, src=source, group=group)


def _receive(group: dist.ProcessGroup, device: torch.device) -> dict:
    length = torch.zeros(1, dtype=torch.long, device=device)
    source = dist.get_global_rank(group, 0)
    dist.broadcast(length, src=source, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=source, group=group)
    return json.loads(payload.cpu().numpy().tobytes().decode())


def _settings(params: SamplingParams) -> dict:
    return {**dataclasses.asdict(params), "stop": list(params.stop)}


def _apply(engine: Engine, message: dict, own: dict[str, Request]) -> None:
    """Queue the message's requests (rank 0: its own Request objects, with their callbacks;
    elsewhere rebuilt from the message) and cancellations, in order."""
    for request_id, prompt_ids, settings in message["submit"]:
        request = own.pop(request_id, None)
        if request is None:
            params = SamplingParams(**{**settings, "stop": tuple(settings["stop"])})
            request = engine.new_request(prompt_ids, params, request_id=request_id)
        with engine.lock:  # admitted on rank 0 already: no queue bound here
            engine.scheduler.waiting.append(request)
    for request_id in message["cancel"]:
        engine.cancel(request_id)


class Leader:
    """Rank 0's engine as the server's engine thread sees it (module docstring): `submit` and
    `cancel` fill the inbox, `has_work` sends it to every rank and applies it; the rest is the
    engine's own."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.group = engine.group
        self.inbox: dict = {"submit": [], "cancel": []}
        self.own: dict[str, Request] = {}  # the inbox's requests, with their callbacks
        self.inbox_lock = threading.Lock()
        self.stopped = False

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # cfg, tokenizer, settings, stats, counters, ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output=None,
               request_id: str | None = None, images: torch.Tensor | None = None) -> Request:
        if images is not None:
            raise RequestError("images are not served under tensor parallelism yet", "messages")
        request = self.engine.new_request(prompt_ids, params, on_output, request_id)
        with self.inbox_lock:
            with self.engine.lock:
                self.engine.check_queue(len(self.inbox["submit"]))
            self.inbox["submit"].append([request.request_id, list(prompt_ids), _settings(params)])
            self.own[request.request_id] = request
        return request

    def cancel(self, request_id: str) -> None:
        with self.inbox_lock:
            self.inbox["cancel"].append(request_id)

    def has_work(self) -> bool:
        """The step boundary: the inbox goes to every rank and into each engine, then whether
        there is a step to take (the same answer on every rank)."""
        with self.inbox_lock:
            message, own = {**self.inbox, "stop": False}, self.own
            self.inbox, self.own = {"submit": [], "cancel": []}, {}
        _send(message, self.group, self.engine.device)
        _apply(self.engine, message, own)
        return self.engine.has_work()

    def abort_all(self, reason: str) -> None:
        """End every request; at shutdown ("cancelled"), also tell the other ranks to stop (once,
        from the thread that stops the engine thread, after it ended)."""
        if reason == "cancelled":  # stopping: the inbox's requests end too (not sent on)
            with self.inbox_lock:
                message, own = {**self.inbox, "stop": True}, self.own
                self.inbox, self.own = {"submit": [], "cancel": []}, {}
            _apply(self.engine, message, own)
        self.engine.abort_all(reason)
        if reason == "cancelled" and not self.stopped:
            self.stopped = True
            _send({"submit": [], "cancel": [], "stop": True}, self.group, self.engine.device)


def follow(engine: Engine) -> None:
    """A rank other than the first: apply rank 0's messages and step with it until it stops.
    A failed step ends its requests, as rank 0's engine thread does (runner.EngineThread)."""
    while True:
        message = _receive(engine.group, engine.device)
        if message["stop"]:
            engine.abort_all("cancelled")
            return
        _apply(engine, message, {})
        if not engine.has_work():
            continue
        try:
            engine.step()
        except Exception:  # noqa: BLE001 - rank 0 fails the same step: both go on
            traceback.print_exc(file=sys.stderr)
            engine.abort_all("error")
