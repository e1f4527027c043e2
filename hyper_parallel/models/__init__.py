"""Model-specific code, one folder per model family (``models/<model_type>/``): async CP adapters
(``async_cp.py``, public path ``models.<model_type>.adapter.distributed.context_parallel_async``),
token-mixer methods with their catalogue rows, and the classes / specs a family registers with a
generic core of ``distributed/context_parallel/mixers``. Importing a family registers it; the
package imports every family here (``hyper_parallel`` imports this package), so the catalogue and
the registries are complete before anything reads them. docs/architecture.md, Recipe 2.

The order is the catalogue's and the messages' (each registry lists in registration order).
"""
from . import llama, qwen2, qwen3, mistral, qwen3_moe  # noqa: F401  async adapters
from . import falcon_h1, bamba, nemotron_h, granitemoehybrid, zamba2  # noqa: F401  Mamba2 core
from . import jamba, falcon_mamba  # noqa: F401  Mamba1 core
from . import lfm2, lfm2_moe, lfm3  # noqa: F401  short-conv halo core
from . import qwen3_next, recurrent_gemma, kimi_linear, minimax, deepseek_v32, doge  # noqa: F401  own methods
from . import qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe, llava, gemma3  # noqa: F401  vision towers spread over CP
