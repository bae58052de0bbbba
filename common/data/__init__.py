"""From competition files to batches: image checks and the conversion into sharded TFRecords with their manifest
(images.py, conversion.py), the record schema, manifest and fold split (records.py), and the tf.data pipelines for
training, validation and inference (pipeline.py).

May import: common.core, common.tasks, TensorFlow (tf.data, tf.io), NumPy, Pillow.
"""
