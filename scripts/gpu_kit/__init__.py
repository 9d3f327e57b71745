"""The GPU validation kit (issue 15): scripts/gpu-check runs check.py; bundle.py packs what a GPU machine
without network needs (bcc, pyelftools, the CUPTI shims) into .gpukit/, carried there by the device tool."""
