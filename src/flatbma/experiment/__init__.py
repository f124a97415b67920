"""The experiment layer: run configs, run directories, the parallel runtime, studies and reports, under the CLI.

It trains through the library's one training core (:mod:`flatbma.training`), as :func:`flatbma.fit_posterior`
does, and adds what a run on disk needs. Its subpackages import one way, each only those before it
(``tests/test_layers.py`` checks it): :mod:`~flatbma.experiment.config` (run configs) at the bottom, then
:mod:`~flatbma.experiment.parallel` (how the processes of a ``torchrun`` launch share a run),
:mod:`~flatbma.experiment.run` (one run, from its config to its metrics), :mod:`~flatbma.experiment.report` (the
tables, documents and figures of a comparison's results), :mod:`~flatbma.experiment.study` (``flatbma
compare``), and on top :mod:`~flatbma.experiment.cli`.
"""
