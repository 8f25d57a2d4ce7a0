"""Engine integrations: the load planner, a Hugging Face transformers helper and a vLLM KV connector."""
