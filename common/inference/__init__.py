"""The inference kernel's side: the exports found and loaded as an ensemble (ensemble.py), each member's test-time
views predicted and averaged (predict.py) within the competition's time limit (time_plan.py), and the submission
written against the competition's template (submission.py).

May import: common.core, common.tasks, common.data, common.export, TensorFlow, NumPy.
"""
