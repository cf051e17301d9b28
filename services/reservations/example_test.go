package reservations_test

import (
	"fmt"

	"github.com/millrace/millrace/services/reservations"
)

// Keys are configured as owner=key pairs; owner:pool|pool=key limits a key
// to some pools.
func ExampleParseKeys() {
	keys, err := reservations.ParseKeys("ml-team=3f9c2a7e41d05b86c1e0, ci:a100|h100=7d1e0aa35e9f674c8e21")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(keys.Len(), "keys")

	_, err = reservations.ParseKeys("ml-team=short")
	fmt.Println(err)
	// Output:
	// 2 keys
	// reservations: line 1: the API key of owner "ml-team" is shorter than 16 characters
}
