"""Engine integrations (vLLM, SGLang, transformers); see docs/integrations.md."""
