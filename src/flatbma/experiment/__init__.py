"""The experiment layer: run configs, run directories, the parallel runtime, studies and reports, under the CLI.

It trains through the library's training core (:mod:`flatbma.training`), as :func:`flatbma.fit_posterior` does,
adding what a run on disk needs. Subpackages import only those before them (``tests/test_layers.py`` checks it):
:mod:`~flatbma.experiment.config`, :mod:`~flatbma.experiment.parallel` (the processes of a ``torchrun`` launch),
:mod:`~flatbma.experiment.run` (one run), :mod:`~flatbma.experiment.report` (tables, documents, figures),
:mod:`~flatbma.experiment.study` (``flatbma compare``), and on top :mod:`~flatbma.experiment.cli`.
"""
