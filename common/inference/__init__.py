"""The inference kernel's side: the exports found and loaded as an ensemble with test-time views (ensemble.py), and
the submission written against the competition's template (submission.py).

May import: common.core, common.tasks, common.data, common.export, TensorFlow, NumPy.
"""
