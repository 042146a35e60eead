# syntax=docker/dockerfile:1
# One image for both binaries: /usr/local/bin/kvroute-operator and /usr/local/bin/kvroute-picker.
#
#   docker build -t ghcr.io/kvroute/kvroute:0.1.0 .
#
# The entrypoint is the picker: the picker Deployments the operator creates pass only
# arguments (operator/src/desired.rs). The chart's operator Deployment sets
# command: [/usr/local/bin/kvroute-operator].

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# the same release build CI runs
RUN cargo build --release --locked -p kvroute-operator -p kvroute-picker

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kvroute-operator /src/target/release/kvroute-picker /usr/local/bin/
# numeric (distroless "nonroot") so the kubelet can check runAsNonRoot
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvroute-picker"]
