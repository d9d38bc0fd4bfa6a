"""The pure core (torch and NumPy only, no Hugging Face imports): the GNMR configuration and controller
(:mod:`~gnmr_hf.core.controller`), the trigger policies behind the ``TriggerPolicy`` protocol
(:mod:`~gnmr_hf.core.policies`) and the oracle diagnostic's maths (:mod:`~gnmr_hf.core.oracle`)."""
