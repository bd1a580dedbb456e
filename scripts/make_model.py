"""Write a seeded, randomly initialised Llama-family checkpoint (a thin command over `offload.testing`).

    python scripts/make_model.py --family llama --size tiny --out /tmp/tiny-llama
"""

from offload.testing.make_model import main

if __name__ == "__main__":
    main()
