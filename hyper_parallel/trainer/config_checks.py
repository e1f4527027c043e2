"""Cross-field checks of a loaded :class:`~hyper_parallel.trainer.config.TrainerConfig`: what the
schema of one field cannot see, run by the CLI's config path (``cli.load_config``) on every rank
before any collective (see :func:`check_run_config`). Separate from ``config.py`` because it reads
the model config (``model.py``), which itself imports the schema."""
from __future__ import annotations

import re

from ..distributed.errors import CPConfigError
from ..distributed.plan.resolver import check_plan_targets
from .config import TrainerConfig
from .hf_config_keys import check_config_keys
from .media import check_media_run
from .pipeline import check_pipeline_run
from .token_id_checks import check_token_ids
from .vocab_rule import vocab_choice


def load_run_config(argv) -> TrainerConfig:
    """``argv[0]`` (the YAML file) + dotted overrides -> :meth:`TrainerConfig.from_yaml` ->
    :func:`check_run_config` (the CLI's and the launcher's config path; local, no collective)."""
    return check_run_config(TrainerConfig.from_yaml(argv[0], list(argv[1:])))


def check_run_config(cfg: TrainerConfig) -> TrainerConfig:
    """What the schema alone cannot see, checked before any rank builds anything (local, no
    collective; the CLI runs it on every rank inside the config-load agreement). Raises one
    CPConfigError naming the field:

    * ``accelerator.device_type``: the device exists on this machine (cuda on a CPU-only machine);
    * ``logging.tensorboard``: the ``tensorboard`` package is installed;
    * ``model.attn_implementation``: one transformers knows (``eager`` or a registered attention)
      whose package is installed (flash-attn, kernels);
    * every key of ``model.config`` / ``config_file`` is a field of the architecture's config class
      (:mod:`.hf_config_keys`, the nearest known name in the message);
    * the HF model config (``model.config`` over ``config_file``, or ``model.path``'s config.json)
      builds, its activation is one transformers has, heads divide (``hidden_size`` by
      ``num_attention_heads`` without an explicit ``head_dim``, ``num_attention_heads`` by
      ``num_key_value_heads``), a rotary ``head_dim`` is even, and ``max_position_embeddings``
      covers ``data.seq_len``;
    * the vocabulary rule (:mod:`.vocab_rule`): a given ``vocab_size`` covers the ids the data can
      produce (256 bytes, or ``len(data.tokenizer)``); ``data.pad_token_id``, the config's
      pad/bos/eos ids and (``data.source: files``) the tokenizer's eos id are below the model's
      vocabulary (:mod:`.token_id_checks`);
    * every ``_target_`` / registry name of ``plan_overrides`` resolves, also for an entry that
      ``cp_size: 1`` skips (:func:`~hyper_parallel.distributed.plan.resolver.check_plan_targets`);
    * ``accelerator.pp_size > 1``: what the pipeline does not combine with yet, and a schedule the
      sizes cannot run (:func:`.pipeline.check_pipeline_run`);
    * ``data.source: media``: a model whose media path is not registered, and what the media source
      does not combine with (:func:`.media.check_media_run`).
    """
    _check_device(cfg.accelerator.device_type)
    if cfg.logging.tensorboard:
        try:
            import tensorboard  # noqa: F401 - torch.utils.tensorboard needs the package
        except ImportError:
            raise CPConfigError("logging.tensorboard", "is true but the tensorboard package is not installed",
                                fix="pip install tensorboard (pinned in constraints.txt), or set it to false") from None
    _check_attn_implementation(cfg.model.attn_implementation)
    check_media_run(cfg)
    text, given = _check_model_config(cfg)
    if text is not None:
        tok = _tokenizer(cfg)
        choice = vocab_choice(cfg, tok)   # a given vocab_size below the data's ids: refused here
        note = ""
        if choice.given is None and not cfg.model.path:
            text.vocab_size, note = choice.rows, " set from the data: vocab_size was not given"
        elif cfg.model.path and text.vocab_size < choice.rows:
            note = f": model.path's {text.vocab_size} resized up to the data's ids"
        check_token_ids(cfg, text, given, tok, data_rows=choice.rows, note=note)
    check_plan_targets(cfg.plan_overrides, cfg.source)
    check_pipeline_run(cfg)
    return cfg


def _check_device(device_type: str | None) -> None:
    if device_type is None:
        return
    from ..platform.device import PlatformError, detect_device_type, get_platform

    try:
        get_platform(device_type)
    except PlatformError as exc:
        raise CPConfigError("accelerator.device_type", f"{device_type!r} is not available on this machine ({exc})",
                            fix=f"use device_type: {detect_device_type()} (or null: auto-detect)") from None


#: attention implementations that need a package of their own (module name, pip name)
_ATTN_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"),
                  "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (FlashAttention-3 hopper build)")}


def _check_attn_implementation(name: str) -> None:
    """``name`` is one transformers knows and whose package is installed: ``flash_attention_2`` /
    ``_3`` need flash-attn, a Hub kernel (``org/repo``) needs ``kernels``."""
    import importlib.util

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    field = "model.attn_implementation"
    if "/" in name:   # a Hub kernel: transformers loads it through the kernels package
        if importlib.util.find_spec("kernels") is None:
            raise CPConfigError(field, f"{name!r} is a Hub kernel, which needs the 'kernels' package (not "
                                "installed)", fix="pip install kernels, or use attn_implementation: sdpa")
        return
    known = ["eager", *(k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if "|" not in k)]
    if name not in known:
        raise CPConfigError(field, f"unknown attention implementation {name!r}",
                            fix=f"use one of {known} (the CP wrappers intercept sdpa)")
    module, pip_name = _ATTN_PACKAGES.get(name, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise CPConfigError(field, f"{name} needs the '{module}' package, which is not installed",
                            fix=f"pip install {pip_name} (CUDA only), or use attn_implementation: sdpa")


def _tokenizer(cfg: TrainerConfig):
    """``data.tokenizer`` loaded (``data.source: files``), else None."""
    if not cfg.data.tokenized or not cfg.data.tokenizer:
        return None
    from .data_sources import load_tokenizer

    return load_tokenizer(cfg.data.tokenizer)


def _checkpoint_text_config(path: str):
    """The text config of a local checkpoint's config.json, or None when it does not load (the
    build reports that, naming model.path)."""
    import transformers

    try:
        hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - reported by the build
        return None
    return getattr(hf, "get_text_config", lambda: hf)()


def _check_model_config(cfg: TrainerConfig):
    """The HF config of ``cfg.model`` (built, never the model) against the rules of
    :func:`check_run_config`; returns (its text config or None, the kwargs the YAML gave)."""
    import transformers
    from transformers.activations import ACT2FN

    from .model import _hf_config_kwargs

    m = cfg.model
    if m.path:   # a local checkpoint's config.json is checked by transformers at the build
        return _checkpoint_text_config(m.path), {}
    if not m.architecture:
        raise CPConfigError("model.architecture", "is required when model.path is not given",
                            fix="set e.g. architecture: llama with a small config")
    kwargs = _hf_config_kwargs(m)
    config_cls = transformers.CONFIG_MAPPING[m.architecture] if m.architecture in transformers.CONFIG_MAPPING \
        else None   # (the lazy mapping's .get() answers None for every key)
    if config_cls is not None:
        check_config_keys(m.architecture, config_cls, kwargs, m.config or {}, m.config_file)
    try:
        hf = transformers.AutoConfig.for_model(m.architecture, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' own validators raise several kinds
        raise CPConfigError(_config_error_field(str(exc), kwargs, m.architecture),
                            f"the {m.architecture} config does not build: " + " ".join(str(exc).split()),
                            fix="fix the value in model.config (or model.config_file)") from None
    text = getattr(hf, "get_text_config", lambda: hf)()
    where = "model.config" + (f" (over {m.config_file})" if m.config_file else "")
    for key, given in (m.config or {}).items():   # a whole number the config class silently replaces
        built = getattr(text, key, None)
        if type(given) is int and type(built) is int and built != given:
            raise CPConfigError(f"model.config.{key}", f"{given} is replaced by {type(text).__name__} with {built} "
                                f"(this architecture derives {key} from other fields)",
                                fix=f"remove {key} from model.config, or set the fields it is derived from")
    for act in ("hidden_act", "hidden_activation"):
        value = getattr(text, act, None)
        if isinstance(value, str) and value not in ACT2FN:
            raise CPConfigError(f"model.config.{act}", f"unknown activation {value!r}",
                                fix=f"use one of {sorted(ACT2FN)}")
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    head_dim = getattr(text, "head_dim", None)
    if isinstance(heads, int) and heads > 0:
        if isinstance(kv, int) and kv > 0 and heads % kv:
            given = m.config or {}   # name the one of the two this config's own model.config changed
            if "num_attention_heads" in given and "num_key_value_heads" not in given:
                raise CPConfigError("model.config.num_attention_heads", f"{heads} is not a multiple of "
                                    f"num_key_value_heads={kv} in {where}", fix=f"use a multiple of {kv}")
            raise CPConfigError("model.config.num_key_value_heads", f"{kv} does not divide num_attention_heads="
                                f"{heads} in {where}", fix="use a divisor of num_attention_heads")
        if "head_dim" not in kwargs and isinstance(hidden, int) and hidden % heads:
            raise CPConfigError("model.config.num_attention_heads", f"{heads} does not divide hidden_size={hidden} "
                                f"in {where}", fix="use a divisor of hidden_size, or set head_dim explicitly")
        if head_dim is None and isinstance(hidden, int):
            head_dim = hidden // heads
    rotary = getattr(text, "rope_theta", None) is not None or getattr(text, "rope_parameters", None) is not None \
        or getattr(text, "rope_scaling", None) is not None
    if rotary and isinstance(head_dim, int) and head_dim % 2:
        field = "model.config.head_dim" if "head_dim" in kwargs else "model.config.num_attention_heads"
        raise CPConfigError(field, f"gives an odd head_dim={head_dim} in {where}: rotary embeddings rotate "
                            "pairs of channels", fix="use an even head_dim (hidden_size / num_attention_heads)")
    max_pos = getattr(text, "max_position_embeddings", None)
    seq_len = getattr(cfg.data, "seq_len", None)
    if isinstance(max_pos, int) and isinstance(seq_len, int) and max_pos < seq_len:
        raise CPConfigError("model.config.max_position_embeddings", f"{max_pos} is below data.seq_len={seq_len} "
                            f"in {where}: positions past it have no embedding",
                            fix=f"set max_position_embeddings >= {seq_len} or shorten data.seq_len")
    return text, kwargs


_CONFIG_MESSAGE_FIELDS = (("Unrecognized model", "model.architecture"),
                          ("hidden size", "num_attention_heads"), ("attention heads", "num_attention_heads"),
                          ("rotary", "head_dim"))


def _config_error_field(message: str, kwargs: dict, architecture: str) -> str:
    """The field transformers' config validation complains about: a ``model.config`` key named in
    ``message`` (the first given one), else one its wording points at, else ``model.config``."""
    named = [k for k in kwargs if re.search(rf"\b{re.escape(str(k))}\b", message)]
    if named:
        return f"model.config.{named[0]}"
    for words, field in _CONFIG_MESSAGE_FIELDS:
        if words.lower() in message.lower():
            return field if field.startswith("model.") else f"model.config.{field}"
    return "model.config"

