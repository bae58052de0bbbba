"""tf_keras under a tf.distribute strategy (TPU, several GPUs, logical CPUs or the default): every backbone,
including a TF Hub SavedModel through hub.KerasLayer."""
