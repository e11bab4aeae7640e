# Image for docker-compose.yml: PostgreSQL 15 with pg_remus, plus remusctl, remus-coordinator and remus-replay-worker.
# Not exercised by CI (the CI machines have no Docker engine); `remusctl cluster up` is the
# tested way to run a local cluster.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
      postgresql-15 postgresql-server-dev-15 libpq-dev protobuf-compiler libclang-dev clang \
      build-essential pkg-config libssl-dev && rm -rf /var/lib/apt/lists/*
RUN cargo install cargo-pgrx --version =0.18.1 --locked && cargo pgrx init --pg15 /usr/lib/postgresql/15/bin/pg_config
WORKDIR /src
COPY . .
RUN cargo build --release && cd pg_remus && cargo pgrx package --pg-config /usr/lib/postgresql/15/bin/pg_config

FROM debian:12
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 etcd-server && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/pg_remus-pg15/ /
COPY --from=build /src/target/release/remusctl /src/target/release/remus-coordinator /src/target/release/remus-replay-worker /usr/local/bin/
