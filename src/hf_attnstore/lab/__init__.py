"""The lab: research and demonstration code on top of the library and the application.

The paper-scale simulator (simulation.py, running the store's own placement code), the ShareGPT replay
(replay.py, replicas.py, costs.py), `make demo` (demo.py), evaluation (evaluation/: PPL, MMLU through
lm-eval, reuse fidelity), the bundled model (models.py) and data (data/). Nothing below imports it.
"""
