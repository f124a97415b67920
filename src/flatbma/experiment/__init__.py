"""The experiment layer: configs, runs, the parallel runtime, studies and reports, under the CLI and the Python API.

Its subpackages import one way, each only those before it (``tests/test_layers.py`` checks it):
:mod:`~flatbma.experiment.config` (run configs) at the bottom, then :mod:`~flatbma.experiment.parallel` (how the
processes of a ``torchrun`` launch share a run), :mod:`~flatbma.experiment.run` (one run, from its config
to its metrics), :mod:`~flatbma.experiment.report` (the tables, documents and figures of a comparison's
results), :mod:`~flatbma.experiment.study` (``flatbma compare``), and on top :mod:`~flatbma.experiment.cli`
and :mod:`~flatbma.fit`.
"""
