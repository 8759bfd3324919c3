"""The mlx-lm model types Edge0 streams.

The test suite builds a tiny random checkpoint of each (``edge0.tiny``) and checks it
bit-identical to mlx-lm on every executor path (``tests/test_architectures.py``); the
The table of docs/MODELS.md lists them. The first six are the families the engine was written against.
"""

from __future__ import annotations

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    'qwen3_moe', 'qwen3_5_moe', 'mixtral', 'deepseek_v3', 'bailing_moe', 'glm4_moe_lite', 'afmoe',
    'bailing_hybrid', 'bailing_moe_linear', 'deepseek', 'deepseek_v2', 'deepseek_v32',
    'deepseek_v41', 'deepseek_v41_text', 'dots1', 'ernie4_5_moe', 'exaone_moe', 'gemma4',
    'gemma4_text', 'gemma4_unified', 'glm4_moe', 'glm_moe_dsa', 'gpt_oss', 'granitemoe',
    'granitemoehybrid', 'hunyuan', 'jamba', 'joyai_llm_flash', 'kimi_k2', 'kimi_k25', 'kimi_k3',
    'kimi_linear', 'kimi_vl', 'Klear', 'laguna', 'lfm2_moe', 'llama4', 'llava', 'longcat_flash',
    'longcat_flash_ngram', 'mellum', 'mimo_v2_flash', 'minimax', 'minimax_m2', 'minimax_m3_vl',
    'mistral3', 'mistral4', 'nemotron_h', 'olmoe', 'phi-msft', 'phimoe', 'phixtral', 'qwen2_moe',
    'qwen3_5', 'qwen3_next', 'qwen3_vl_moe', 'solar_open', 'step3p5',
)

# The model types whose greedy text under a two-rank pipeline (mlx.launch, edge0.exec.pipeline)
# equals one process's, checked on each one's tiny checkpoint by the slow test
# tests/test_distributed.py::test_every_model_type_under_two_ranks (`pytest -m slow`). A pipeline
# refuses the others: their layers return more than the hidden state, their sanitize step reads
# the layers another rank stands in for, their embedding or head is not where mlx-lm's
# Llama-style models keep it, or their caches do not follow one cache per layer.
PIPELINE_MODEL_TYPES: frozenset[str] = frozenset({
    'qwen3_moe', 'qwen3_5_moe', 'mixtral', 'deepseek_v3', 'glm4_moe_lite', 'afmoe', 'deepseek',
    'deepseek_v2', 'dots1', 'ernie4_5_moe', 'exaone_moe', 'glm4_moe', 'gpt_oss', 'granitemoe',
    'granitemoehybrid', 'jamba', 'joyai_llm_flash', 'kimi_k2', 'kimi_k25', 'kimi_vl', 'Klear',
    'laguna', 'llama4', 'llava', 'mellum', 'mimo_v2_flash', 'minimax', 'minimax_m2', 'mistral3',
    'mistral4', 'olmoe', 'phimoe', 'qwen2_moe', 'qwen3_5', 'qwen3_next', 'solar_open', 'step3p5',
})
