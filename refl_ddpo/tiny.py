"""`python -m refl_ddpo.tiny OUT ...`, kept working: the tiny models are refl_ddpo.testing.tiny's."""

from refl_ddpo.testing.tiny import main

if __name__ == "__main__":
    main()
