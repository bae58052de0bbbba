"""Keras 3 on JAX with keras.distribution.DataParallel over every JAX device: the route that needs no TensorFlow TPU
build. TensorFlow only reads the data; the export is rebuilt under Keras 3's TensorFlow backend in a child."""
