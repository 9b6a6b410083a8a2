"""fuselab experiments: run each as `python -m experiments.<name>` from the repository root."""
