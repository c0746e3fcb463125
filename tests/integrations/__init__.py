"""vattn inside other servers (vattn.integrations): transformers (continuous batching, vattn
serve), vLLM and SGLang (stand-ins, patches, plugins)."""
