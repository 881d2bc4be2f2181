"""Where a target's parts are, asked of transformers' own model of it rather than looked up by name.

- The decoder: the transformers model that holds the ModuleList of decoder layers (the one with
  the most parameters, as many layers as the config has), found by walking the model. Llama 4's
  `get_decoder()` returns the CausalLM itself (its decoder sits at `.model`); a multimodal wrapper
  holds a vision tower's blocks beside its language model's layers.
- The input embedding and the LM head: `get_input_embeddings()` / `get_output_embeddings()` of the
  model built on the meta device from the config (no memory, no weights), mapped to checkpoint keys
  the way transformers maps them when it loads (its renames: NemotronH stores `backbone.*` for its
  `model.*`), else the one checkpoint tensor of the embedding's shape. Tied: no head of its own.

`checkpoint_tensors` caches what it finds in a directory its caller names ($DFLASH_MP_CACHE/
target-tensors for the preflight and the drafter ranks), keyed by the config, the checkpoint's
tensor names and the transformers version: the preflight finds them once, drafter ranks read two
names instead of importing the target's modelling code (about 1.5 CPU-seconds each), and
`load_embedding_and_head` reads the two tensors under them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_mp.models.target_checkpoint import read_tensor, tensor_files, tensor_shapes

STRUCTURE_VERSION = 1  # bump when what checkpoint_tensors finds changes for the same inputs


class TargetStructureError(ValueError):
    """A part of the target that the trainer needs and cannot find; the message names it."""


@dataclass(frozen=True)
class CheckpointTensors:
    embedding: str  # the input embedding's key in the checkpoint
    head: str | None  # the LM head's; None when it is tied to the embedding


def locate_decoder(model: nn.Module, num_layers: int) -> tuple[str, str]:
    """(path of the decoder in `model`, name of its ModuleList of layers): of the ModuleLists of
    `num_layers` modules held by a transformers model, the one with the most parameters."""
    from transformers import PreTrainedModel

    candidates = []
    for path, module in model.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue  # the decoder's forward is a base model's: input_ids in, last_hidden_state out
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == num_layers and num_layers > 0:
                size = sum(p.numel() for p in child.parameters())
                candidates.append((size, -path.count("."), path, name))
    if not candidates:
        raise TargetStructureError(
            f"{type(model).__name__} holds no list of {num_layers} decoder layers in a transformers "
            "model (the layers the drafter's features come from)"
        )
    _, _, path, name = max(candidates)
    return path, name


def cut_to_layers(text_config: Any, kept: int) -> int:
    """Cut `text_config` to its first `kept` layers, as the target ranks build the target: the
    count, and the per-layer types where the config stores them (NemotronH derives its count from
    them). Jamba, Bamba and Falcon-H1 derive their types from the count, read-only: those follow it."""
    text_config.num_hidden_layers = kept
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and len(layer_types) != kept:
        try:
            text_config.layer_types = layer_types[:kept]
        except AttributeError as error:  # derived, but not from num_hidden_layers
            raise TargetStructureError(
                f"{type(text_config).__name__} cannot be cut to its first {kept} layers: its "
                f"layer_types ({len(layer_types)} entries) is derived from other fields ({error})"
            ) from error
    return kept


def cut_problem(path: str | Path, kept: int, trust_remote_code: bool = False) -> str | None:
    """Why the target at `path` cut to its first `kept` layers (on the meta device: no memory)
    does not build with a decoder of `kept` layers as the target ranks build it; None when it does."""
    try:
        locate_decoder(meta_model(path, trust_remote_code, kept_layers=kept), kept)
    except TargetStructureError as e:
        return f"cut to the {kept} layers the drafter reads: {e}"
    except Exception as e:  # noqa: BLE001 - transformers' own refusal of the cut config
        return f"transformers cannot build it cut to the {kept} layers the drafter reads ({_first_line(e)})"
    return None


def find_decoder(model: nn.Module, num_layers: int) -> nn.Module:
    """The module that runs the `num_layers` decoder layers and the final norm (see locate_decoder)."""
    path, _ = locate_decoder(model, num_layers)
    return model.get_submodule(path)


def decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    """The decoder's ModuleList of layers: its ModuleList child with the most parameters."""
    lists = [c for c in decoder.children() if isinstance(c, nn.ModuleList) and len(c)]
    if not lists:
        raise TargetStructureError(f"{type(decoder).__name__} holds no list of decoder layers")
    return max(lists, key=lambda c: sum(p.numel() for p in c.parameters()))


def layers_name(decoder: nn.Module) -> str:
    """The attribute of `decoder` that holds its layers."""
    layers = decoder_layers(decoder)
    return next(name for name, child in decoder.named_children() if child is layers)


def meta_model(
    path: str | Path, trust_remote_code: bool = False, kept_layers: int | None = None
) -> nn.Module:
    """The target's CausalLM on the meta device (no memory); with `kept_layers`, cut after them as
    the target ranks build it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if kept_layers is not None:
        cut_to_layers(config.get_text_config(), kept_layers)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def checkpoint_tensors(
    path: str | Path, trust_remote_code: bool = False, cache_dir: Path | None = None
) -> CheckpointTensors:
    """The checkpoint keys of the target's input embedding and LM head, kept in `cache_dir` (see the
    module doc; None: found every time); TargetStructureError naming what is missing."""
    files = tensor_files(path)
    if cache_dir is None:
        return find_checkpoint_tensors(path, files, trust_remote_code)
    cache = cache_dir / f"{_digest(Path(path), files, trust_remote_code)}.json"
    try:
        return CheckpointTensors(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    tensors = find_checkpoint_tensors(path, files, trust_remote_code)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(tensors)))
        partial.replace(cache)  # whole or absent for a reader in another process
    except OSError:
        pass  # a read-only cache: found again next time
    return tensors


def load_embedding_and_head(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    trust_remote_code: bool = False,
    names_cache: Path | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head matrices, both [V, H], without building the model.

    With tied embeddings the head is the embedding tensor itself, not a copy. `names_cache`: where
    the two tensors' names are kept once found (checkpoint_tensors).
    """
    files = tensor_files(path)
    names = checkpoint_tensors(path, trust_remote_code, names_cache)
    embedding = read_tensor(files, names.embedding).to(device=device, dtype=dtype)
    if names.head is None:
        return embedding, embedding
    return embedding, read_tensor(files, names.head).to(device=device, dtype=dtype)


def find_checkpoint_tensors(
    path: str | Path, files: dict[str, Path], trust_remote_code: bool = False
) -> CheckpointTensors:
    """checkpoint_tensors without the cache: builds the meta model and checks its decoder too."""
    try:
        model = meta_model(path, trust_remote_code)
    except Exception as e:  # noqa: BLE001 - an unknown model_type, remote code not trusted, a bad field
        raise TargetStructureError(f"transformers cannot build its model ({_first_line(e)})") from e
    locate_decoder(model, model.config.get_text_config().num_hidden_layers)
    embedding, head = _embedding_and_head(model)
    keys = _model_keys_to_checkpoint_keys(model, files)
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return CheckpointTensors(
        embedding=_checkpoint_key(names[id(embedding)], embedding, keys, files, "input embedding"),
        head=None if head is None else _checkpoint_key(names[id(head)], head, keys, files, "LM head"),
    )


def _embedding_and_head(model: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The input embedding's weight and the LM head's (None: tied to it)."""
    try:
        embedding = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError) as e:
        raise TargetStructureError(f"{type(model).__name__} exposes no input embedding ({e})") from e
    head_module = model.get_output_embeddings()
    head = getattr(head_module, "weight", None)
    if head is None:
        raise TargetStructureError(f"{type(model).__name__} exposes no LM head (get_output_embeddings)")
    return embedding, None if head is embedding else head


def _model_keys_to_checkpoint_keys(model: nn.Module, files: dict[str, Path]) -> dict[str, str]:
    """Model parameter name -> checkpoint key, renamed as transformers renames checkpoint keys when
    it loads them (its conversion mapping, the base-model prefix added or stripped)."""
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamed = {rename_source_key(k, renamings, converters, prefix, state)[0]: k for k in files}
    except Exception:  # noqa: BLE001 - another transformers version: exact names and the prefix only
        renamed = {f"{prefix}.{k}": k for k in files} | {k: k for k in files}
    return {name: key for name, key in renamed.items() if name in state}


def _checkpoint_key(
    name: str, param: nn.Parameter, keys: dict[str, str], files: dict[str, Path], what: str
) -> str:
    """The checkpoint key of the model's parameter `name`: as transformers maps it, else (the last
    resort) the one tensor of its shape that maps to no parameter of the model."""
    if name in keys:
        return keys[name]
    claimed = set(keys.values())  # tensors of other parameters
    shaped = [k for k, s in tensor_shapes(files).items() if s == tuple(param.shape) and k not in claimed]
    if len(shaped) == 1:
        return shaped[0]
    raise TargetStructureError(
        f"its safetensors hold no {what} (the model's {name}, {list(param.shape)}"
        + (f"; {len(shaped)} unnamed tensors of that shape" if shaped else "")
        + ")"
    )


def _digest(path: Path, files: dict[str, Path], trust_remote_code: bool) -> str:
    import transformers

    digest = hashlib.sha256()
    for part in (STRUCTURE_VERSION, transformers.__version__, trust_remote_code, *sorted(files)):
        digest.update(f"{part}\n".encode())
    for file in [path / "config.json", *sorted(path.glob("*.py"))]:  # remote code, if any
        digest.update(file.read_bytes() if file.is_file() else b"")
    return digest.hexdigest()[:24]


def structure_problem(
    path: str | Path, trust_remote_code: bool = False, cache_dir: Path | None = None
) -> str | None:
    """What the trainer cannot find in the target at `path` (its decoder layers, input embedding, LM
    head), in one line; None when it finds them all or the directory holds no safetensors (the
    doctor's target check names missing weights)."""
    path = Path(path)
    try:
        tensor_files(path)
    except FileNotFoundError:
        if any(path.glob("*.bin")):
            return (
                "holds *.bin weights only; the drafter ranks read the target's embedding and head "
                "from safetensors: resave it with save_pretrained (safetensors is its default)"
            )
        return None
    except (OSError, ValueError, KeyError) as e:
        return f"its safetensors index cannot be read ({_first_line(e)})"
    try:
        checkpoint_tensors(path, trust_remote_code, cache_dir)
    except TargetStructureError as e:
        return str(e)
    return None


def _first_line(error: Any) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
