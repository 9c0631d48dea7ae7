"""graphkit_train: the training runtime (full training and forward/backward training)."""
