"""The keys an HF config class understands, so a typo in ``model.config`` (``num_hiden_layers``)
is refused instead of becoming an attribute nobody reads; and the kwargs the ``model`` section gives
(:func:`hf_config_kwargs`)."""
from __future__ import annotations

import difflib
import json
import functools
import importlib.util
import inspect
import re
from pathlib import Path

from ..distributed.errors import CPConfigError

__all__ = ["known_config_keys", "check_config_keys"]


@functools.lru_cache(maxsize=None)
def known_config_keys(config_cls) -> frozenset:
    """Every name ``config_cls`` (a ``PretrainedConfig`` subclass) and its bases accept: their
    ``__init__`` parameters and annotations, class-level fields and properties, the attributes of a
    default instance, ``attribute_map`` aliases, the legacy keys every config converts
    (``rope_theta``, ...) and the attributes its modeling file reads (:func:`_modeling_reads`; not for
    a composite config such as a VLM's, whose modeling file reads its ``text_config`` /
    ``vision_config``: a top-level ``hidden_act`` there would be stored and never read)."""
    names: set = set()
    for klass in inspect.getmro(config_cls):
        if klass is object:
            continue
        try:
            params = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            params = ()
        names.update(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        names.update(getattr(klass, "attribute_map", {}) or {})
        names.update(getattr(klass, "__annotations__", {}) or {})
        names.update(k for k, v in vars(klass).items()   # class-level fields (model_type) and properties
                     if not k.startswith("_") and (isinstance(v, property) or not callable(v))
                     and not isinstance(v, (classmethod, staticmethod)))
    try:
        names.update(vars(config_cls()))
    except Exception:  # noqa: BLE001 - a class without usable defaults: its signature is enough
        pass
    names.update(_LEGACY_KEYS)
    if not getattr(config_cls, "sub_configs", None):   # a composite config's modeling file reads its sub-configs
        names.update(_modeling_reads(config_cls))
    names.discard("self")
    return frozenset(n for n in names if not n.startswith("__"))


#: keys every config converts in its __post_init__ (legacy spellings of declared fields)
_LEGACY_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype", "num_labels")
_READS = (re.compile(r"\bconfig\.([A-Za-z_]\w*)"),
          re.compile(r"getattr\(\s*(?:self\.)?(?:text_)?config\s*,\s*[\"']([A-Za-z_]\w*)[\"']"),
          re.compile(r"hasattr\(\s*(?:self\.)?(?:text_)?config\s*,\s*[\"']([A-Za-z_]\w*)[\"']"))


def _modeling_reads(config_cls) -> set:
    """Config attributes the architecture's modeling file reads without declaring them
    (``getattr(config, "head_dim", ...)`` in Qwen3-MoE): read from its source text, not imported."""
    module = getattr(config_cls, "__module__", "")
    if ".configuration_" not in module:
        return set()
    try:
        spec = importlib.util.find_spec(module.replace(".configuration_", ".modeling_"))
        text = Path(spec.origin).read_text() if spec is not None and spec.origin else ""
    except (ImportError, ValueError, OSError):
        return set()
    return {m for rx in _READS for m in rx.findall(text)}


#: YAML 1.1 booleans that the YAML 1.2 loader keeps as strings (a string is truthy in a config)
_YAML11_BOOLS = frozenset({"yes", "no", "on", "off", "y", "n"})


def check_config_keys(architecture: str, config_cls, kwargs: dict, given: dict,
                      config_file: str | None) -> None:
    """Raise CPConfigError for the first key of ``kwargs`` that ``config_cls`` does not know,
    naming it as ``model.config.<key>`` (``given``: the YAML's own model.config) or as a key of
    ``config_file``, with the nearest known name; and for a value spelled as a YAML 1.1 boolean
    (``yes`` / ``off``: a non-empty string, hence true, in the config)."""
    known = known_config_keys(config_cls)
    for key, value in kwargs.items():
        if isinstance(value, str) and value.strip().lower() in _YAML11_BOOLS:
            field = f"model.config.{key}" if key in given or not config_file else "model.config_file"
            raise CPConfigError(field, f"{key}: {value!r} is a string under YAML 1.2 (only true/false are "
                                "booleans), and any non-empty string counts as true",
                                fix="write true or false")
        if not isinstance(key, str) or key in known:
            continue
        near = difflib.get_close_matches(key, sorted(known), n=1)
        field = f"model.config.{key}" if key in given or not config_file else "model.config_file"
        where = "" if field.endswith(key) else f" ({config_file}: key {key!r})"
        raise CPConfigError(field, f"{key!r} is not a field of the {architecture} config "
                            f"({config_cls.__name__}){where}; it would be stored and never read",
                            fix=f"did you mean {near[0]!r}?" if near else
                            f"remove it (the known keys are {config_cls.__name__}'s fields)")


def hf_config_kwargs(cfg) -> dict:
    """The HF config kwargs of the ``model`` section: ``config`` merged over ``config_file``."""
    from .config import load_yaml_text
    from .paths import resolve_path

    kwargs = dict(cfg.config or {})
    if cfg.config_file:
        path = resolve_path(cfg.config_file)
        if not path.exists():
            raise CPConfigError("model.config_file", f"{path} does not exist")
        text = path.read_text()
        loaded = json.loads(text) if path.suffix == ".json" else load_yaml_text(text, "model.config_file")
        kwargs = {**loaded, **kwargs}
    return kwargs
