//go:build tools

// Package tools pins the main packages scripts/k8s-bins.sh builds, so `go mod tidy` keeps
// their dependencies in go.sum. Nothing here is compiled into a program.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "helm.sh/helm/v3/cmd/helm"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
