"""The training backends: one folder per route of the route table (common/launch/routes.py ROUTES), and
torch_shared/ for what both PyTorch routes share. What every backend shares is written once in base.py; the backend
starts in registry.py.

A folder's modules take their names from MODULES, one name per role, so the same job has the same name on every route
(as Keras's backend folders do). Every route has backend.py; the other roles are there where the route has that job
(the PyTorch routes' model and export are torch_shared's).

May import: everything below common.training, and its own framework (tf_keras / Keras 3 + JAX / PyTorch).
"""

MODULES = {
    "backend": "the Backend of base.py and start(cfg): every route has one",
    "model": "the model under the route's framework, its backbone from the family's builder (launch/backbones.py)",
    "export": "the SavedModel contract written from the trained weights",
    "capture": "whether the export will take the model, asked before training",
    "optimizer": "the optimiser train.optimizer names, in the framework's own form",
    "step": "the training step, where the route writes its own",
    "processes": "the processes training together, and their collectives",
    "compiles": "the programs compiled: counted, and kept in the compile cache",
    "pace": "how much of a step the devices compute and the host waits",
    "iterators": "the distributed input iterators, and how they are let go",
    "augment": "the augmentations applied to the batch on the device",
    "tensors": "batches and checkpoints as the framework's tensors",
}
SHARED = "_shared"  # a folder named <framework>_shared holds what several routes share, and is no route
