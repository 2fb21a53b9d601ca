"""Glue for training libraries that own the loop: ``lowprec.integrations.transformers``
(``transformers.Trainer`` and TRL's trainers, which run on it). Each module imports its library;
nothing else in lowprec imports them, so ``import lowprec`` never needs those libraries."""

__all__: list[str] = []
