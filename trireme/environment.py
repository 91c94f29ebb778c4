"""Every environment variable trireme reads, and the one it sets: the launcher's and the system's,
and the server's API key. trireme's own settings are config keys and command-line flags, never
environment variables. `trireme config-doc` (docs/config.md) prints these lists, and
tests/test_architecture.py fails on a read of a variable not in READ (or a write of one not in
SET) anywhere in the package.
"""

from __future__ import annotations

READ: dict[str, str] = {
    "RANK": "this process's rank among all (torchrun; 0 without it): only rank 0 prints a "
            "one-line error",
    "WORLD_SIZE": "the number of processes (torchrun); 1 without it",
    "LOCAL_RANK": "this process's rank on its node (torchrun): the GPU it takes",
    "LOCAL_WORLD_SIZE": "processes on this node (torchrun): the CPU threads each one gets, and "
                        "the check that the node has a GPU for each",
    "MASTER_ADDR": "the address of rank 0 (torchrun): needed, with MASTER_PORT and RANK, to "
                   "start a run of several processes",
    "MASTER_PORT": "the port of rank 0 (torchrun)",
    "TORCHELASTIC_RESTART_COUNT": "which restart of the run this is (torchrun --max-restarts): "
                                  "each attempt meets the other ranks under its own prefix",
    "OMP_NUM_THREADS": "CPU threads per process, when set (else trireme picks them from the "
                       "cores and the processes on the node)",
    "XDG_CACHE_HOME": "where downloaded and prepared corpora are kept, under trireme/ "
                      "(default ~/.cache)",
    "TRIREME_API_KEY": "the default of `trireme serve --api-key`",
}

SET: dict[str, str] = {
    "CUBLAS_WORKSPACE_CONFIG": "set to :4096:8 for train.deterministic = true (cuBLAS needs "
                               "it for deterministic GEMMs), unless it is set already: a value "
                               "given is kept",
}

def reference_markdown() -> str:
    """The section of docs/config.md that lists these variables."""
    out = ["## Environment variables", "",
           "trireme reads these (and no other; its own settings are the keys above and the "
           "commands' flags):", "", "| variable | meaning |", "|---|---|"]
    out += [f"| `{name}` | {meaning} |" for name, meaning in READ.items()]
    out += ["", "and sets this one:", "", "| variable | meaning |", "|---|---|"]
    out += [f"| `{name}` | {meaning} |" for name, meaning in SET.items()]
    return "\n".join(out + [""])
