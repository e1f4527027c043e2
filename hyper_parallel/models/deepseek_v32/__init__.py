"""deepseek_v32 model code under CP (DeepSeek sparse attention; GLM-MoE-DSA shares it)."""
