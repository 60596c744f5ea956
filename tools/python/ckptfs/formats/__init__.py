"""Checkpoints of other formats into a ckptfs repository, and checkpoints out
to them:

- a torch.distributed.checkpoint (DCP) directory (``.metadata`` and
  ``__R_K.distcp`` files; also what Megatron-Core's ``torch_dist`` format
  writes): each saved chunk becomes a box shard of its tensor, as it was
  saved, so checkpoints DCP wrote at different world sizes share their
  chunks; non-tensor items (pickled by DCP) become blobs of the same name.
  The ``.metadata`` pickle is read by ckptfs.pickles, which runs no code
  from it unless the caller trusts the file (``dcp_in``).
- a ``torch.save`` file of a (possibly nested) state dict, read with
  ``torch.load(weights_only=True)``, which refuses anything but tensors and
  plain containers and numbers: tensors are stored under their keys and
  indexes joined with ``.`` (dicts with str or int keys, lists and tuples
  holding tensors are walked), other parts as blobs, and the whole shape
  as the blob ``ckptfs.torch.structure`` (``torch_in``).
- a Hugging Face model directory whose weights are ``torch.save`` files
  (``pytorch_model.bin``, or the shards ``pytorch_model.bin.index.json``
  names, as transformers wrote them before safetensors), read with
  ``torch.load(weights_only=True)``: each tensor under its name, checked
  against the index, and the directory's other files (config, tokenizer)
  as blobs of the same names, as for safetensors model directories.
- safetensors files and Hugging Face model directories with safetensors
  weights go to the engine's own importer
  (``Repository.import_safetensors``).

Exports (``export``) write a model directory of safetensors files, a DCP
directory (``export_dcp``) or one torch.save file (``export_torch``),
durably and resumably (``writing``).

``python -m ckptfs.formats import NAME PATH`` (``__main__``) is what
``ckpt import`` runs for the formats that need torch.
"""

from .common import DCP_FILES_BLOB, PARTIAL_SUFFIX, STRUCTURE_BLOB, detect
from .export import export_checkpoint
from .importing import import_checkpoint
from .torch_in import structure_of_dcp_metadata
from .writing import hf_shards, parse_size

__all__ = ["detect", "import_checkpoint", "export_checkpoint", "parse_size", "hf_shards", "structure_of_dcp_metadata",
           "STRUCTURE_BLOB", "DCP_FILES_BLOB", "PARTIAL_SUFFIX"]
