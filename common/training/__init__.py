"""Training a fold and the folds of a run: the plan (plan.py: batch, steps, schedule), the time budget (budget.py),
the batch a fold runs at (batch.py: auto's choice, a weighed step, the retry after a first step's out of memory),
a device's memory (memory.py: the runtimes' out-of-memory words and the line they end in, peak memory), one fold
(fold.py), the end of each epoch (epoch.py, with its clock.py and history.py), the run over folds (run.py),
finishing a fold into its export (finish.py), and the backends that build, fit and export a model (backends/:
tf_keras under tf.distribute, Keras 3 on JAX, PyTorch/XLA, plain PyTorch).

May import: common.core, common.tasks, common.data, common.export; plan.py and budget.py stay pure (no TensorFlow).
"""
