"""Training a fold and the folds of a run: the plan (plan.py: batch, steps, schedule), the time budget (budget.py),
one fold (fold.py), the run over folds (run.py), finishing a fold into its export (finish.py), and the backends that
build, fit and export a model (backends/: tf_keras under tf.distribute, Keras 3 on JAX).

May import: common.core, common.tasks, common.data, common.export; plan.py and budget.py stay pure (no TensorFlow).
"""
