"""How the processes of a ``torchrun`` launch share a run: the process group, its loaders, the run's strategy."""
