"""torch.distributed.checkpoint (DCP) over pieces: the planners, and the file reader / writer.

`PieceSavePlanner` turns each piece (pieces.py) into a DCP write item of its global tensor;
DCP's global planning then dedups replicated chunks and checks that the chunks tile each tensor.
`PieceLoadPlanner` asks DCP for the parts of the stored chunks that overlap each piece and hands
out the piece's own view as the destination, so the data lands in place. `SafeReader` is DCP's
file reader with `.metadata` read by the restricted unpickler (torch's reader calls pickle.load
on it) and errors naming the data file; `Writer` is DCP's file writer.
Only public DCP classes are subclassed or built here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from trireme.checkpoint.safe_pickle import load_dcp_metadata
from trireme.errors import CheckpointError

DCP_METADATA = ".metadata"


class PieceSavePlanner(DefaultSavePlanner):
    """Writes each piece as a chunk of its global tensor (DCP dedups replicated chunks)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict  # Entries, not tensors: nothing to flatten
        self.mappings = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items, seen = [], set()
        for key, entry in self.state_dict.items():
            for piece in entry.pieces:
                if (key, piece.offsets) in seen:  # a rank holding both tied embedding copies
                    continue
                seen.add((key, piece.offsets))
                chunk = ChunkStorageMetadata(offsets=torch.Size(piece.offsets),
                                             sizes=torch.Size(piece.data.shape))
                items.append(WriteItem(
                    index=MetadataIndex(key, piece.offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk,
                                                properties=TensorProperties(dtype=entry.dtype),
                                                size=torch.Size(entry.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        entry = self.state_dict[write_item.index.fqn]
        offsets = tuple(write_item.index.offset)
        piece = next(p for p in entry.pieces if tuple(p.offsets) == offsets)
        return piece.data.detach().to("cpu").contiguous()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads the parts of the stored chunks that overlap each piece, straight into its view."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the state dict holds Entries, not tensors: none of the default's tensor preparation
        self.original_state_dict = self.state_dict = state_dict
        self.mappings = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, entry in self.state_dict.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                           sizes=torch.Size(p.data.shape)) for p in entry.pieces]
            requests += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        piece = self.state_dict[read_item.dest_index.fqn].pieces[read_item.dest_index.index]
        view = piece.data
        for d, (a, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(d, a, n)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out the destination itself


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by the restricted unpickler (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = load_dcp_metadata(Path(self.path) / DCP_METADATA, tensors_only=True)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner):
        """torch's reading, one data file at a time, so that an error names the file."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path,
                               []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(LoadPlan(items), planner).wait()
            except Exception as e:
                raise CheckpointError(f"{Path(self.path) / name} is corrupted or unreadable "
                                      f"({type(e).__name__}: {reason(e)})") from e
        done: Future = Future()
        done.set_result(None)
        return done


class Writer(FileSystemWriter):
    """DCP's file writer; `written` lists the data files this rank wrote."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        # the data files this rank wrote (sharded.write records their sha256 in meta.json)
        self.written = sorted({r.storage_data.relative_path for r in future.wait()})
        return future

    def storage_meta(self):
        meta = super().storage_meta()
        if meta is not None:  # a str, not a PosixPath: the safe reader resolves no pathlib class
            meta.checkpoint_id = str(meta.checkpoint_id)
        return meta



# --------------------------------------------------------------------------------------------
# Save


def reason(e: BaseException) -> str:
    """One line for an error; DCP's CheckpointException carries each failing rank's traceback,
    whose last line is the error itself."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__
