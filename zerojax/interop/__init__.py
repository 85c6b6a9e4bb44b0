"""The field's files in and out, driven by a family's declared layout (`models.family.HfLayout`):

    safetensors.py   a lazy reader (slices by positioned reads) and an in-place writer
    hf.py            Hugging Face checkpoints: into the sharded master layout, and out as shards
    peft.py          LoRA adapters in PEFT's names and files

Nothing here names a model family.

The package names nothing: import the module (`from zerojax.interop import hf`).
"""
