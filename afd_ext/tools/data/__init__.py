"""Package data of afd_ext: model configs (models/*.json) and the demo prompts (prompts.txt)."""
