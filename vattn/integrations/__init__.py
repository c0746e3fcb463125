"""The plug-in side: how other frameworks run their unmodified models on a vattn cache.

`vattn.integrations.hf`: Hugging Face `transformers` (an attention function registered
under the name "vattn").
"""
