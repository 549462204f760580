"""A seeded, randomized schedule explorer on the real stack: writers, relay runs and faults drawn from one seed,
checked by an oracle of its own against a model of what must be sent (`python -m tests.explorer --seed N`)."""
