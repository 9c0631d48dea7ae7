"""The trainers: the loop (:mod:`.base`), the estimator protocol (:mod:`.estimator`),
the checks of their parameters and data (:mod:`.params`), full training (:mod:`.full`)
and forward/backward training (:mod:`.partial`)."""
