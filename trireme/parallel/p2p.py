"""Point-to-point exchange between neighbours: pipeline stages, the ranks of an attention ring.

Every message's shape is known in advance (activations and their gradients are [b, s, h], or
[b, s / T, h] under sequence parallelism), so receivers allocate their buffers from the config and
no shape handshake is needed. The sends and receives of one schedule tick are posted together with
`batch_isend_irecv`, in the order of the tick's message list, which both ends share (NCCL matches
point-to-point messages between two ranks by their order).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def start_exchange(transfers: list[tuple[str, Tensor, int]], group: dist.ProcessGroup
                   ) -> list[dist.Work]:
    """Post ("send" | "recv", tensor, peer) transfers together and return their works, to wait
    on later (the caller may compute meanwhile and must not touch the tensors until then); peers
    are ranks of `group`, receive buffers are filled in place. Both ends list their shared
    messages in the same order."""
    ops = [
        dist.P2POp(dist.isend if what == "send" else dist.irecv, tensor, group=group,
                   group_peer=peer)
        for what, tensor, peer in transfers
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def exchange(transfers: list[tuple[str, Tensor, int]], group: dist.ProcessGroup) -> None:
    """Run transfers together (as `start_exchange`) and wait for them."""
    for work in start_exchange(transfers, group):
        work.wait()
