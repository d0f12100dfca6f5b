from setuptools import find_packages, setup

setup(
    name="lmengine",
    version="0.1.0",
    description="A research inference engine for LLMs on PyTorch and transformers",
    packages=find_packages(include=["lmengine", "lmengine.*"]),
    # the held-out text of the w8a8 check, the prompts of `lmengine bench` (examples/prompts.txt
    # links to them) and the C++ sources of the CPU kernels (compiled on first use), so that a
    # non-editable install has them too
    package_data={
        "lmengine.quant": ["data/*.txt"],
        "lmengine": ["data/*.txt"],
        "lmengine.kernels": ["csrc/*.cpp", "csrc/*.h"],
    },
    python_requires=">=3.10",
    # NOTE: torch is pinned to a range that the CPU wheel installed first satisfies, so pip
    # never pulls a CUDA build on top of it. transformers is pinned because the patches
    # subclass its modules.
    install_requires=[
        "torch>=2.5,<2.14",
        "transformers>=5.23,<5.24",
        "safetensors>=0.4",
        "accelerate>=1.0",
        "peft>=0.13",
        "triton>=3.0; platform_system == 'Linux'",
        "gguf>=0.10",
        "tqdm>=4.60",
        "psutil>=5.9",
        "numpy>=1.24",
        # structured outputs (grammar-constrained sampling); tested: 0.2.8
        "xgrammar>=0.2.8,<0.3",
    ],
    extras_require={
        # tested: fastapi 0.165, uvicorn 0.54, openai 3.54 (server tests use the client)
        "serve": ["fastapi>=0.110,<1", "uvicorn>=0.29,<1", "openai>=1.30,<4"],
        # tested: schemathesis 4.32 (the OpenAPI fuzz test of the server); lm-eval 0.4.13
        # (lm-evaluation-harness against the server; its `api` extra has the HTTP client);
        # smg 1.13 (SGLang's model gateway: replicas behind a router, tests/test_router.py);
        # ruff and mypy pinned to a minor release (tested: 0.17.6, 2.4.1), since a new one
        # formats or infers differently and .ci/run checks both; pre-commit runs them per commit
        "test": [
            "pytest>=8",
            "ruff>=0.17,<0.18",
            "mypy>=2.4,<2.5",
            "pre-commit>=4,<5",
            "schemathesis>=4.0,<5",
            "lm-eval[api]==0.4.13",
            "smg==1.13.0",
            # the clients of the Responses, Messages and chat doors, as applications use them
            # (tests/test_server_responses.py, _anthropic.py, _frameworks.py; tested:
            # anthropic 2.14, openai-agents 0.24, langchain-openai 1.7, instructor 1.17, which
            # holds jiter below 0.15 and so openai at 3.3 and pydantic-ai-slim at 2.38)
            "anthropic>=2.0,<3",
            "openai-agents>=0.20,<1",
            "langchain-openai>=1.0,<2",
            "pydantic-ai-slim[openai]>=2.0,<3",
            "instructor>=1.10,<2",
        ],
        "bench": ["matplotlib>=3.7,<4"],  # benchmarks/policies.py plots
    },
    entry_points={"console_scripts": ["lmengine=lmengine.cli:main"]},
)
