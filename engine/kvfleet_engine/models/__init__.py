"""Single-device model code for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3)."""
