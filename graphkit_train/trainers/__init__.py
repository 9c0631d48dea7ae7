"""The trainers: full training (:mod:`.full`) and forward/backward training
(:mod:`.partial`), on what they share (:mod:`.base`, which composes the rest): the
training loop (:mod:`.loop`), the checks of the data ``fit`` takes (:mod:`.fit_data`),
the held-out loss and early stopping (:mod:`.held_out`), resuming, warm starts and
pickling (:mod:`.checkpointing`), the exports of the trained model (:mod:`.exports`),
the estimator protocol (:mod:`.estimator`), the checks of their parameters and data
(:mod:`.params`) and the parameters they share, described and checked once
(:mod:`.shared`)."""
