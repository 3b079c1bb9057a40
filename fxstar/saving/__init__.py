"""Checkpoints: an engine's parameters and training state on disk, so a run resumes exactly.

The guide is docs/checkpoints.md. One idea a module:

    checkpoint.py      save, load, Checkpoint (what load returns, and `apply` to an engine)
    view.py            TrainingView: what a checkpoint reads from and writes into an engine,
                       made in one place (`view_of`); nothing else here sees the engine
    layouts/           one module per way the ranks of one model share a checkpoint: one
                       process, tensor-parallel ranks (and 2-D meshes), data-parallel ranks;
                       each writes a view into a directory and reads it back; and the
                       checkpoint's logical state, of which a rank of another mesh takes its
                       share (logical_state.py, reshard.py)
    training_state.py  the step, RNG, optimizer and saved-along state, checked before restored
    rng.py             the random generators' state
    file_format.py     the files of a checkpoint, their checksums and the manifest
    json_tree.py       a training state as JSON and tensors
    verified_reads.py  reading the files, each checked against its checksum first
    directory.py       the atomic swap, scratch directories and leftovers, the lock, and the
                       rule that a save never deletes what fxstar did not write
    collective.py      what ranks that save together exchange
"""

from fxstar.errors import CheckpointError
from fxstar.saving.checkpoint import Checkpoint, load, load_parameters, mismatches, save
from fxstar.saving.directory import resolve, write_atomically
from fxstar.saving.file_format import (
    ALIASES_KEY,
    FORMAT,
    MANIFEST,
    MARKER,
    PARAMETERS,
    STATE,
    TENSORS,
    VERSION,
    rank_parameters_file,
    rank_tensors_file,
)
from fxstar.saving.rng import rng_state, set_rng_state
from fxstar.saving.training_state import RESERVED, restore_training_state, training_state
from fxstar.saving.verified_reads import verified_files
from fxstar.saving.view import TrainingView, World, view_of

__all__ = [
    "ALIASES_KEY",
    "FORMAT",
    "MANIFEST",
    "MARKER",
    "PARAMETERS",
    "RESERVED",
    "STATE",
    "TENSORS",
    "VERSION",
    "Checkpoint",
    "CheckpointError",
    "TrainingView",
    "World",
    "load",
    "load_parameters",
    "mismatches",
    "rank_parameters_file",
    "rank_tensors_file",
    "resolve",
    "restore_training_state",
    "rng_state",
    "save",
    "set_rng_state",
    "training_state",
    "verified_files",
    "view_of",
    "write_atomically",
]
