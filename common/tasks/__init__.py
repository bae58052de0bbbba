"""What a task type is, in one place: multiclass, binary, multilabel and regression as Task values (types.py) made of
small parts (parts.py: label parsing, losses, scorers, submission text) and the scores and plots of a report
(reports.py). Adding a task type touches types.py alone.

May import: common.core, NumPy, scikit-learn, matplotlib (in functions); TensorFlow or Keras only through the ops a
backend passes in.
"""
